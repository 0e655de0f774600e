"""One decoding loop for every drafter (gpt-fast's ``speculative_decode`` shape): the speculation policy decides the
step's draft (:func:`specdraft.speculation.propose`), :func:`specdraft.step.speculative_step` feeds it to the target
in one forward, verifies it and rolls the cache back to the accepted path, the loop commits.

With :class:`~specdraft.drafters.base.NoDrafter` every draft is empty and the same loop is plain autoregressive
decoding, so the baseline and speculative decoding share every line of bookkeeping.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from specdraft.drafters.base import Drafter, NoDrafter, TargetFeatures, share_target_cache, target_features
from specdraft.errors import SpecdraftError
from specdraft.models.base import CausalLM
from specdraft.sampling import SamplingConfig
from specdraft.speculation import SPECULATION, FixedPolicy, SpeculationPolicy, StepBounds, make_policy, propose
from specdraft.stats import GenerationStats
from specdraft.step import STEP_ROOM, OneSequence, StepInput, speculative_step
from specdraft.stopping import Stopper


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings, validated on construction."""

    max_new_tokens: int = field(default=128, metadata={"help": "most tokens to generate"})
    num_draft_tokens: int = field(default=4, metadata={"help": "γ: draft tokens proposed per target forward (the "
                                                                "most, with adaptive speculation)"})
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eos_token_ids: tuple[int, ...] = field(default=(), metadata={"help": "ids that end generation (kept)"})
    stop_strings: tuple[str, ...] = field(default=(), metadata={"help": "texts that end generation (kept)"})
    speculation: str = field(default="adaptive", metadata={
        "help": "adaptive: each step proposes what maximises expected tokens/s on this machine; fixed: γ always"})

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise SpecdraftError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens}")
        if not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 1:
            raise SpecdraftError(f"num_draft_tokens must be an integer >= 1, got {self.num_draft_tokens}")
        if self.speculation not in SPECULATION:
            raise SpecdraftError(f"speculation must be one of {', '.join(SPECULATION)}, got {self.speculation!r}")


@dataclass
class GenerationResult:
    """Generated ids (prompt excluded), why generation ended, and the stats of this generation."""

    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats


def check_inputs(prompt_ids: Sequence[int] | torch.Tensor, target: CausalLM, drafter: Drafter,
                 max_new: int) -> torch.Tensor:
    """The prompt as a (N,) long tensor, after checking it and the drafter against the target (a clear error for an
    empty prompt, an id out of range, a context too long, a vocabulary mismatch)."""
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()  # (N,)
    if prompt.numel() == 0:
        raise SpecdraftError("empty prompt: give at least one token")
    if int(prompt.min()) < 0 or int(prompt.max()) >= target.vocab_size:
        raise SpecdraftError(f"prompt token id out of range for the target vocabulary of {target.vocab_size}")
    for who, limit in (("target", target.max_context), ("draft", drafter.max_context)):
        if limit is not None and prompt.numel() + max_new > limit:
            raise SpecdraftError(
                f"prompt too long: {prompt.numel()} prompt tokens + max_new_tokens {max_new} exceed the {who} "
                f"model's context of {limit}"
            )
    if drafter.vocab_size is not None and drafter.vocab_size != target.vocab_size:
        raise SpecdraftError(
            f"vocabulary mismatch: target {target.name!r} has {target.vocab_size} logits, "
            f"drafter {drafter.name!r} has {drafter.vocab_size}"
        )
    return prompt


def _prefill(target: CausalLM, cache, prompt: torch.Tensor, features: TargetFeatures | None) -> torch.Tensor | None:
    """Feed all of the prompt but its last token, on the causal path, before the first step (as gpt-fast does):
    every step then feeds one uncached token and its draft, and a tree step never runs its masked forward over a
    long prompt. Returns the prompt's features (L - 1, D) when the drafter reads them, else None."""
    if prompt.shape[0] < 2:
        return None
    args = {} if features is None else features.forward_args()
    out = target.forward(prompt[:-1].unsqueeze(0), cache, logits_to_keep=1, **args)
    return out[1][0] if features is not None else None


@torch.inference_mode()
def generate(
    target: CausalLM,
    prompt_ids: Sequence[int] | torch.Tensor,
    drafter: Drafter | None = None,
    config: GenerationConfig | None = None,
    generator: torch.Generator | None = None,
    tokenizer=None,
    policy: SpeculationPolicy | None = None,
) -> GenerationResult:
    """Generate from ``target`` after ``prompt_ids`` (batch 1), speculatively when a drafter is given.

    Lossless: greedy output equals plain greedy decoding token for token; sampled output follows the target's
    warped distribution exactly (Leviathan et al. 2023, Appendix A). ``tokenizer`` is needed only for stop strings.
    ``policy`` decides how much to propose each step (:mod:`specdraft.speculation`); by default one is made from
    ``config.speculation`` for this call (pass one to carry what it learns across generations).
    """
    config = config or GenerationConfig()
    drafter = drafter or NoDrafter()
    if policy is None:
        plain = isinstance(drafter, NoDrafter)
        policy = FixedPolicy(0) if plain else make_policy(target, config.speculation, config.num_draft_tokens)
    prompt = check_inputs(prompt_ids, target, drafter, config.max_new_tokens)
    stopper = Stopper(config.max_new_tokens, config.eos_token_ids, config.stop_strings, tokenizer)
    needed = prompt.numel() + config.max_new_tokens
    cache = target.new_cache(min(needed + STEP_ROOM, target.max_context))  # room for tree and auxiliary slots
    drafter.begin(target, cache)
    share_target_cache(drafter, cache)  # GliDe reads the target's keys and values
    features = target_features(drafter)  # Medusa / EAGLE read the target's features
    one = OneSequence(target, cache, features)
    context, generated, stats, reason = prompt, [], GenerationStats(), None
    start = time.perf_counter()
    prefill_features = _prefill(target, cache, prompt, features)  # (L - 1, D) or None
    stats.prefill_seconds = time.perf_counter() - start
    while reason is None:
        tick = time.perf_counter()
        bounds = StepBounds(config.max_new_tokens - len(generated) - 1, cache.capacity - context.shape[0],
                            target.max_context - 1 - context.shape[0])
        draft = propose(policy, drafter, context, cache.length, bounds, config.sampling, generator)
        tock = time.perf_counter()
        (step,) = speculative_step(one, [StepInput(context, draft, config.sampling, generator)])
        verified = time.perf_counter()
        result = step.result
        if prefill_features is not None:  # the drafter sees the prompt's features with the first step's
            result, prefill_features = replace(result, hidden=torch.cat([prefill_features, result.hidden])), None
        keep, reason = stopper.scan(generated, step.tokens)
        generated += step.tokens[:keep]
        context = torch.cat([context, torch.tensor(step.tokens[:keep], dtype=torch.long)])
        drafter.observe(result)
        policy.observe(draft, result, tock - tick, verified - tock)
        stats.record_step(result, keep, draft_s=tock - tick, verify_s=verified - tock)
    stats.decode_seconds = time.perf_counter() - start
    return GenerationResult(generated, reason, stats)
