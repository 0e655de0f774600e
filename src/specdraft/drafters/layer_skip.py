"""Layer-skip self-speculative decoding: the target drafts for itself with some decoder layers skipped.

Draft & Verify (Zhang et al. 2023, arXiv 2309.08168) drafts with the target's own weights, skipping a fixed set of
intermediate layers, and verifies the draft with the whole model in one forward; no second model and no training.
Which layers to skip is chosen once, offline: Draft & Verify searches attention and MLP sublayers with Bayesian
optimisation scored by decoding speed on a few prompts. SWIFT (Xia et al. 2024, arXiv 2410.06916) fixes the
number of skipped layers by a skip ratio and searches the set (random search, then Bayesian optimisation) to
maximise a "matchness" score: how often the skipped model's draft tokens match the full model's tokens on text
the model produced. Here, as in SWIFT, whole layers are skipped at a fixed ratio, and the set is found by a cheap
search (random sets, then first-improvement swaps; exhaustive when the space is small) maximising a proxy that
needs only forwards, no generation: on teacher-forced calibration prompts, how often a one-token draft through the
kept layers (on the full model's cache of the context) equals the full model's greedy prediction, i.e. the greedy
acceptance rate of the first draft token. The first and last layers are never skipped. The chosen set is cached
in ``<specdraft cache>/layer_skip.json`` keyed by model name and ratio, so a second run does not recalibrate.

Sharing the target's KV cache (Draft & Verify reuses the full model's keys and values of the context): with
``L = cache.length`` at entry, :meth:`LayerSkipDrafter.propose` feeds the uncached tail of the context, then each
draft token, through the kept layers only. Every decoder layer attends only its *own* layer's cache slots, so a
kept layer sees the full model's keys/values at positions ``< L`` (written by earlier verify forwards) and the
draft pass's own keys/values at ``L ..``; the skipped layers' slots at ``L ..`` are never read while drafting. At
the end the cache is cropped back to ``L`` (free for the static cache), and the decoding loop's verify forward
rewrites every layer's slots from ``L`` on with the full model. So verification, and the output, is exactly the
target's: greedy decoding is unchanged token for token, and sampled drafts carry their warped probabilities q so
that speculative sampling stays lossless (Leviathan et al. 2023).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import random
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specdraft.drafters.base import Draft, DrafterFacts
from specdraft.drafters.options import build
from specdraft.errors import SpecdraftError
from specdraft.models.native_llama import NativeLlama
from specdraft.models.registry import cache_dir
from specdraft.prompts import BUILTIN_PROMPTS, encode_prompt
from specdraft.sampling import SamplingConfig, argmax, check_finite, sample, warp
from specdraft.verification import VerifyResult

log = logging.getLogger(__name__)

CACHE_FILE = "layer_skip.json"
MAX_CALIBRATION_TOKENS = 256  # longer calibration prompts are cut: the proxy needs a few hundred positions, not more


@dataclass(frozen=True)
class Calibration:
    """A chosen skip set, its proxy score (greedy match rate, 0 .. 1) and how many sets were scored."""

    skip: tuple[int, ...]
    score: float
    evaluated: int


def _require_native(target) -> NativeLlama:
    if not isinstance(target, NativeLlama):
        raise SpecdraftError(
            f"layer-skip needs a Llama-family target served natively (NativeLlama); {getattr(target, 'name', target)!r}"
            " is a transformers model (load it with backend 'auto' or 'native')"
        )
    return target


def parse_skip(text: str, num_layers: int) -> tuple[int, ...]:
    """``"3,5,7"`` -> (3, 5, 7): distinct layer indices in ``0 .. num_layers - 1``, at least one layer kept."""
    try:
        skip = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise SpecdraftError(f"layer-skip option skip={text!r}: expected comma-separated layer indices") from None
    if any(not 0 <= i < num_layers for i in skip):
        raise SpecdraftError(f"layer-skip option skip={text!r}: layer indices must lie in 0 .. {num_layers - 1}")
    if len(skip) >= num_layers:
        raise SpecdraftError(f"layer-skip option skip={text!r} skips all {num_layers} layers; keep at least one")
    return tuple(skip)


def skip_count(num_layers: int, skip_ratio: float) -> int:
    """How many layers a ratio skips: ``round(ratio * num_layers)``, from the middle layers 1 .. n - 2 only."""
    if not 0.0 < skip_ratio < 1.0:
        raise SpecdraftError(f"layer-skip option skip_ratio must be in (0, 1), got {skip_ratio}")
    count = round(skip_ratio * num_layers)
    if not 1 <= count <= num_layers - 2:
        raise SpecdraftError(
            f"skip_ratio {skip_ratio} skips {count} of {num_layers} layers; calibration skips 1 .. {num_layers - 2}"
            " (never the first or last layer)"
        )
    return count


def _kept(skip: Sequence[int], num_layers: int) -> list[int]:
    dropped = set(skip)
    return [i for i in range(num_layers) if i not in dropped]


class _MatchScorer:
    """The proxy: how often a one-token draft through the kept layers equals the full model's greedy prediction,
    at every position of the calibration sequences (the greedy acceptance rate of a first draft token).

    Each sequence is prefilled once with the full model into slots ``0 .. N-1``. A candidate feeds the sequence
    again, through the kept layers only, into slots ``N .. 2N-1`` with a mask under which position t sees the full
    model's slots ``< t`` and its own new slot: what a kept layer sees when drafting right after position t - 1,
    for all t in one forward. Positions in the prefix every sequence shares (a chat template's system turn) are
    not scored; scores are memoised per skip set.
    """

    def __init__(self, target: NativeLlama, sequences: Sequence[Sequence[int]]) -> None:
        self.target = target
        keep = min(MAX_CALIBRATION_TOKENS, target.max_context // 2)  # each sequence takes 2N cache slots
        self.sequences = [torch.as_tensor(s[:keep], dtype=torch.long) for s in sequences]
        if not self.sequences or any(s.numel() < 2 for s in self.sequences):
            raise SpecdraftError("layer-skip calibration needs sequences of at least 2 tokens")
        if any(int(s.min()) < 0 or int(s.max()) >= target.vocab_size for s in self.sequences):
            raise SpecdraftError(f"calibration token id out of range for the vocabulary of {target.vocab_size}")
        self.start = min(_shared_prefix(self.sequences), min(s.numel() for s in self.sequences) - 1)
        self.caches = [target.new_cache(2 * s.numel()) for s in self.sequences]
        self.reference = [  # (N_i - start,) each: the full model's greedy predictions
            target.forward(ids.unsqueeze(0), cache)[0, self.start :].argmax(-1)
            for ids, cache in zip(self.sequences, self.caches, strict=True)
        ]
        self.masks = [_draft_mask(s.numel()) for s in self.sequences]
        self.memo: dict[tuple[int, ...], float] = {}

    def predictions(self, layers: list[int]) -> list[torch.Tensor]:
        """One-token draft predictions at the scored positions of every sequence, each (N_i - start,)."""
        out = []
        for ids, cache, mask in zip(self.sequences, self.caches, self.masks, strict=True):
            cache.crop(ids.numel())  # keep the full model's slots, drop the previous candidate's
            positions = torch.arange(ids.numel())  # (N,)
            logits = self.target.forward(ids.unsqueeze(0), cache, positions, mask, layers=layers)[0]  # (N, V)
            out.append(logits[self.start :].argmax(-1))  # (N - start,)
        return out

    def __call__(self, skip: tuple[int, ...]) -> float:
        if skip not in self.memo:
            predicted = self.predictions(_kept(skip, len(self.target.layers)))
            matches = sum(int((p == r).sum()) for p, r in zip(predicted, self.reference, strict=True))
            self.memo[skip] = matches / sum(r.numel() for r in self.reference)
        return self.memo[skip]


def _draft_mask(length: int) -> torch.Tensor:
    """(N, 2N) bool: row t sees the cached slots 0 .. t-1 and new slot N + t."""
    cached = torch.ones(length, length, dtype=torch.bool).tril(-1)  # (N, N) strictly causal
    return torch.cat([cached, torch.eye(length, dtype=torch.bool)], dim=1)  # (N, 2N)


def _shared_prefix(sequences: list[torch.Tensor]) -> int:
    if len(sequences) == 1:
        return 0
    length = 0
    while all(s.numel() > length and s[length] == sequences[0][length] for s in sequences):
        length += 1
    return length


def _local_search(score: _MatchScorer, best: tuple[int, ...], middle: list[int], budget: int, rng: random.Random):
    """First-improvement hill climbing over swaps (one skipped layer for one kept middle layer)."""
    improved = True
    while improved and len(score.memo) < budget:
        improved = False
        swaps = [(s, m) for s in best for m in middle if m not in best]
        rng.shuffle(swaps)
        for out, into in swaps:
            if len(score.memo) >= budget:
                break
            candidate = tuple(sorted(set(best) - {out} | {into}))
            if score(candidate) > score(best):
                best, improved = candidate, True
                break
    return best


@torch.inference_mode()
def calibrate_skip(
    target, sequences: Sequence[Sequence[int]], skip_ratio: float = 0.5, search_steps: int = 32, seed: int = 0
) -> Calibration:
    """Choose ``round(skip_ratio * n)`` middle layers to skip, maximising the first-draft-token match rate.

    SWIFT-style search (Xia et al. 2024): every set when there are at most ``search_steps``; else half the budget
    on random sets (the first evenly spaced), the rest on first-improvement swaps from the best. Deterministic for
    a seed. Returns the set, its score and the number of sets scored.
    """
    target = _require_native(target)
    if search_steps < 1:
        raise SpecdraftError(f"layer-skip option search_steps must be >= 1, got {search_steps}")
    num_layers = len(target.layers)
    count = skip_count(num_layers, skip_ratio)
    middle = list(range(1, num_layers - 1))
    score = _MatchScorer(target, sequences)
    if math.comb(len(middle), count) <= search_steps:
        best = max(itertools.combinations(middle, count), key=score)  # the first of equal scores: deterministic
        return Calibration(best, score(best), len(score.memo))
    rng = random.Random(seed)
    spaced = tuple(sorted({middle[round(i * (len(middle) - 1) / max(count - 1, 1))] for i in range(count)}))
    candidates = [spaced] if len(spaced) == count else []
    while len(candidates) < max(1, search_steps // 2):
        candidates.append(tuple(sorted(rng.sample(middle, count))))
    best = max(candidates, key=score)
    best = _local_search(score, best, middle, search_steps, rng)
    return Calibration(best, score(best), len(score.memo))


def _cache_key(target: NativeLlama, skip_ratio: float) -> str:
    return f"{target.name}|skip_ratio={skip_ratio:g}"


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load_cached(target: NativeLlama, skip_ratio: float) -> Calibration | None:
    """A skip set stored by an earlier calibration of this model and ratio, or None."""
    entry = _read_cache(cache_dir() / CACHE_FILE).get(_cache_key(target, skip_ratio))
    num_layers = len(target.layers)
    try:
        if entry["num_layers"] != num_layers:
            return None
        skip = tuple(int(i) for i in entry["skip"])
        if not skip or any(not 1 <= i < num_layers - 1 for i in skip):
            return None
        return Calibration(skip, float(entry["score"]), int(entry["evaluated"]))
    except (KeyError, TypeError, ValueError):
        return None


def store_cached(target: NativeLlama, skip_ratio: float, calibration: Calibration) -> Path:
    """Add this calibration to the cache file (written atomically); returns the file."""
    path = cache_dir() / CACHE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _read_cache(path)
    data[_cache_key(target, skip_ratio)] = {
        "skip": list(calibration.skip), "score": calibration.score, "evaluated": calibration.evaluated,
        "num_layers": len(target.layers),
    }
    handle, tmp = tempfile.mkstemp(prefix=f".{CACHE_FILE}.", dir=path.parent)
    with os.fdopen(handle, "w") as file:
        json.dump(data, file, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path


def builtin_calibration_ids(tokenizer) -> list[list[int]]:
    """The first built-in prompt of each category (:data:`specdraft.prompts.BUILTIN_PROMPTS`; the second of a
    category often repeats the first's passage), in the chat template when there is one."""

    if tokenizer is None:
        raise SpecdraftError("layer-skip calibration needs the target's tokenizer (or give skip=LAYERS)")
    chat = bool(getattr(tokenizer, "chat_template", None))
    first = {prompt.category: prompt for prompt in reversed(BUILTIN_PROMPTS)}
    prompts = [prompt for prompt in BUILTIN_PROMPTS if first[prompt.category] is prompt]
    return [encode_prompt(tokenizer, prompt.text, chat=chat) for prompt in prompts]


class LayerSkipDrafter:
    """Draft with the target itself, skipping decoder layers, on the target's own KV cache (Draft & Verify).

    Args:
        target: the NativeLlama being decoded (the same object the decoding loop hands to :meth:`begin`).
        skip: comma-separated layer indices to skip; empty: calibrate (or reuse the cached set) at ``skip_ratio``.
        skip_ratio: fraction of the layers to skip when calibrating, in (0, 1).
        calibrate: recalibrate even when a cached set exists.
        search_steps: most skip sets scored by the calibration search.
        seed: seed of the calibration search.
        tokenizer: encodes the built-in calibration prompts (not needed with ``skip`` or ``calibration``).
        calibration: token id sequences to calibrate on instead of the built-in prompts.
    """

    vocab_size = None
    max_context = None

    method = "layer-skip"
    facts = DrafterFacts(cpu_only=True, batchable=False, reads_target_cache=True)  # it drafts through them

    @classmethod
    def from_options(cls, target, tokenizer, options: dict[str, str]) -> LayerSkipDrafter:
        """``--drafter layer-skip``: skips calibrated on the built-in prompts (options: the constructor's)."""
        return build(cls, options, target=target, tokenizer=tokenizer, calibration=None)

    def __init__(
        self,
        target,
        skip: str = "",
        skip_ratio: float = 0.5,
        calibrate: bool = False,
        search_steps: int = 32,
        seed: int = 0,
        tokenizer=None,
        calibration: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.target = _require_native(target)
        num_layers = len(self.target.layers)
        self.calibration: Calibration | None = None
        if skip.strip():
            self.skip = parse_skip(skip, num_layers)
        else:
            self.calibration = self._calibrated(skip_ratio, calibrate, search_steps, seed, tokenizer, calibration)
            self.skip = self.calibration.skip
        self.kept = _kept(self.skip, num_layers)
        self.name = f"layer-skip[{','.join(map(str, self.skip))}]"
        self._cache = None
        log.info("layer-skip: skipping layers %s of %d", list(self.skip), num_layers)

    def _calibrated(self, skip_ratio, calibrate, search_steps, seed, tokenizer, calibration) -> Calibration:
        skip_count(len(self.target.layers), skip_ratio)  # a bad ratio fails before any work
        found = None if calibrate else load_cached(self.target, skip_ratio)
        if found is None:
            sequences = calibration if calibration is not None else builtin_calibration_ids(tokenizer)
            found = calibrate_skip(self.target, sequences, skip_ratio, search_steps, seed)
            path = store_cached(self.target, skip_ratio, found)
            log.info("layer-skip: calibrated %s (match rate %.3f, %d sets), saved to %s",
                     list(found.skip), found.score, found.evaluated, path)
        return found

    def begin(self, target, cache) -> None:
        if target is not self.target:
            raise SpecdraftError("layer-skip drafts with the target it was built for; got a different target")
        self._cache = cache

    @torch.inference_mode()
    def propose(
        self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Draft:
        """Draft through the kept layers on the shared cache, then crop it back (see the module docstring)."""
        cache = self._cache
        if cache is None:
            raise SpecdraftError("layer-skip: begin(target, cache) must be called before propose")
        start = cache.length
        tokens, probs = [], []
        try:
            logits = self.target.forward(context[start:].unsqueeze(0), cache, layers=self.kept)[0, -1]  # (V,)
            for i in range(num_draft_tokens):
                check_finite(logits, "draft")
                if sampling.greedy:
                    token = argmax(logits)
                else:
                    probs.append(warp(logits, sampling))  # (V,) q, warped as p will be
                    token = sample(probs[-1], generator)
                tokens.append(token)
                if i + 1 < num_draft_tokens:  # the last draft token is fed by the verify forward
                    logits = self.target.forward(token.view(1, 1), cache, layers=self.kept)[0, -1]  # (V,)
        finally:
            cache.crop(start)  # the verify forward rewrites every layer's slots from here on
        draft = torch.stack(tokens) if tokens else torch.empty(0, dtype=torch.long)  # (γ,)
        return Draft(draft, torch.stack(probs) if probs else None)

    def observe(self, result: VerifyResult) -> None:
        pass
