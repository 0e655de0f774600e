"""Logit warping, done once: temperature, top-k and top-p turn logits into the probabilities p (target) and
q (draft) on which all acceptance math runs (Leviathan et al. 2023: speculative sampling stays exact for
any warping applied identically to both models).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NoReturn, Protocol, runtime_checkable

import numpy as np
import torch

from specdraft.errors import SpecdraftError
from specdraft.models import rowgemm

# Temperatures below this decode greedily, as vLLM does (its ``_SAMPLING_EPS``): dividing fp32 logits by a smaller
# positive number can overflow to inf (1e-300 is 0 in fp32), and softmax then gives NaN. The limit T -> 0 of the
# warped distribution is the argmax (spread over exact ties, where greedy takes the first).
GREEDY_BELOW = 1e-5
_FP32_MAX = float(torch.finfo(torch.float32).max)


@dataclass(frozen=True)
class SamplingConfig:
    """How to turn logits into a next-token distribution. ``temperature`` 0 (or below ``GREEDY_BELOW``) means
    greedy (argmax)."""

    temperature: float = field(default=0.0, metadata={"help": "0 = greedy (so is any value below 1e-5); > 0 scales "
                                                              "logits by 1/temperature"})
    top_k: int = field(default=0, metadata={"help": "keep the k most likely tokens; 0 = off"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus: smallest set with mass >= top_p; 1 = off"})

    def __post_init__(self) -> None:
        number = (int, float)  # comparisons, unlike math.isnan, take ints of any size; NaN fails every range
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, number) or \
                not 0 <= self.temperature < _FP32_MAX:
            raise SpecdraftError(f"temperature must be a number >= 0 and finite in float32 (below {_FP32_MAX:.3g}), "
                                 f"got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SpecdraftError(f"top_k must be an integer >= 0, got {self.top_k}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, number) or not 0.0 < self.top_p <= 1.0:
            raise SpecdraftError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


class LogitsProcessor(Protocol):
    """Changes the target's logits before warping (:func:`warp` runs once, after), at every row of a verify, each row
    seeing the tokens before it: row 0 follows the committed tokens, row i + 1 follows them and the draft's path to
    node i. Speculative sampling stays exact for any such processing, since p is processed row by row exactly as
    plain decoding would process it at that position (Leviathan et al. 2023, Appendix A, for any p)."""

    def __call__(self, logits: torch.Tensor, generated: torch.Tensor, tokens: torch.Tensor,
                 parents: torch.Tensor | None) -> torch.Tensor:
        """Args:
            logits: (n + 1, V) the target's logits at the root and at every draft node.
            generated: (G,) the tokens generated so far (the prompt excluded).
            tokens: (n,) the draft's tokens; parents: (n,) its tree, or None for a chain.
        Returns:
            (n + 1, V) float32 processed logits.
        """
        ...


@runtime_checkable
class ForkingProcessor(Protocol):
    """A processor with state of its own per sequence (a grammar matcher): each sequence decodes with a fork, told the
    most tokens the sequence generates (``budget``, its stop token included; None: not said)."""

    def fork(self, budget: int | None = None) -> LogitsProcessor:
        ...


@runtime_checkable
class DraftChecker(Protocol):
    """A processor that knows, before verification, which draft tokens it forbids outright (a grammar)."""

    def allowed_nodes(self, generated: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor | None
                      ) -> torch.Tensor:
        """(n,) bool: whether each draft node's path (after ``generated``) can still have p > 0."""
        ...


@runtime_checkable
class ForcesTokens(Protocol):
    """A processor that knows where its constraint leaves one continuation only (a grammar), and gives it as tokens
    to propose (never to commit: the target verifies them)."""

    def forced_tokens(self, generated: torch.Tensor, drafted: torch.Tensor, limit: int) -> list[int]:
        """Up to ``limit`` tokens forced after ``generated`` (G,) and then ``drafted`` (d,); [] where none is."""
        ...

    def certain_stop(self, generated: torch.Tensor) -> int | None:
        """The stop token after ``generated`` (G,) when the constraint allows no other token there (the processed
        p is a point mass on it, so it needs no target forward); None elsewhere."""
        ...


@runtime_checkable
class ClosesAtBudget(Protocol):
    """A processor that may end an answer early to keep it complete within its budget (a grammar) and says when it
    did."""

    def closed_at_budget(self, generated: torch.Tensor) -> bool:
        """Whether closing within the budget changed ``generated`` (G,): at some position the token the row would
        have ranked first without the close was refused."""
        ...


@dataclass(frozen=True)
class ChainedProcessors:
    """Several processors applied in order (penalties and a grammar mask); forks and draft checks pass through."""

    processors: tuple

    def __call__(self, logits: torch.Tensor, generated: torch.Tensor, tokens: torch.Tensor,
                 parents: torch.Tensor | None) -> torch.Tensor:
        for processor in self.processors:
            logits = processor(logits, generated, tokens, parents)
        return logits

    def fork(self, budget: int | None = None) -> ChainedProcessors:
        return ChainedProcessors(tuple(p.fork(budget) if isinstance(p, ForkingProcessor) else p
                                       for p in self.processors))

    def allowed_nodes(self, generated: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor | None
                      ) -> torch.Tensor:
        allowed = torch.ones(tokens.shape[0], dtype=torch.bool)  # (n,)
        for processor in self.processors:
            if isinstance(processor, DraftChecker):
                allowed &= processor.allowed_nodes(generated, tokens, parents)
        return allowed

    def forced_tokens(self, generated: torch.Tensor, drafted: torch.Tensor, limit: int) -> list[int]:
        """The first forcing processor's forced tokens (a mask after it cannot allow more than it does)."""
        forcing = next((p for p in self.processors if isinstance(p, ForcesTokens)), None)
        return [] if forcing is None else forcing.forced_tokens(generated, drafted, limit)

    def certain_stop(self, generated: torch.Tensor) -> int | None:
        """The first forcing processor's certain stop token (a mask is -inf elsewhere, which no bias undoes)."""
        forcing = next((p for p in self.processors if isinstance(p, ForcesTokens)), None)
        return None if forcing is None else forcing.certain_stop(generated)

    def closed_at_budget(self, generated: torch.Tensor) -> bool:
        return any(p.closed_at_budget(generated) for p in self.processors if isinstance(p, ClosesAtBudget))


def chain_processors(*processors: LogitsProcessor | None) -> LogitsProcessor | None:
    """The processors given (None ones left out) as one: None, the only one, or :class:`ChainedProcessors`."""
    kept = tuple(p for p in processors if p is not None)
    return None if not kept else kept[0] if len(kept) == 1 else ChainedProcessors(kept)


def path_counts(generated: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor | None,
                vocab_size: int) -> torch.Tensor:
    """How often each token occurs before each row of a verify: the generated tokens, then the draft's path.

    Args:
        generated: (G,); tokens: (n,); parents: (n,) with parents before children, or None for a chain.
    Returns:
        (n + 1, V) float32 counts: row 0 counts ``generated``, row i + 1 adds the path from the root to node i.
    """
    base = torch.bincount(generated, minlength=vocab_size).float()  # (V,)
    steps = torch.nn.functional.one_hot(tokens, vocab_size).float()  # (n, V)
    if parents is None:
        return torch.cat([base[None], base + steps.cumsum(0)])  # (n + 1, V)
    counts = base.repeat(tokens.shape[0] + 1, 1)  # (n + 1, V)
    for node, parent in enumerate(parents.tolist()):
        counts[node + 1] = counts[parent + 1] + steps[node]
    return counts


@dataclass(frozen=True)
class LogitPenalties:
    """OpenAI's ``logit_bias``, ``frequency_penalty`` and ``presence_penalty`` as a :class:`LogitsProcessor`:
    logit[t] + bias[t] - frequency_penalty * c[t] - presence_penalty * (c[t] > 0), where c[t] counts token t in the
    text generated so far (the prompt excluded, as vLLM does), draft tokens before the row included."""

    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    @property
    def active(self) -> bool:
        return bool(self.logit_bias) or self.frequency_penalty != 0 or self.presence_penalty != 0

    def __call__(self, logits: torch.Tensor, generated: torch.Tensor, tokens: torch.Tensor,
                 parents: torch.Tensor | None) -> torch.Tensor:
        out = logits.float().clone()  # (n + 1, V)
        if self.logit_bias:
            ids = torch.tensor([t for t, _ in self.logit_bias], dtype=torch.long)  # (B,)
            out[:, ids] += torch.tensor([b for _, b in self.logit_bias], dtype=torch.float32)
        if self.frequency_penalty or self.presence_penalty:
            counts = path_counts(generated, tokens, parents, out.shape[-1])  # (n + 1, V)
            out -= self.frequency_penalty * counts + self.presence_penalty * (counts > 0).float()
        return out


def warp(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p, in that order (as transformers' warpers).

    Args:
        logits: (..., V) raw logits.
    Returns:
        (..., V) float32 probabilities summing to 1 on the last axis. Greedy gives the one-hot argmax.
    """
    logits = logits.float()
    if sampling.greedy:
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).float()
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)  # (..., V)
    if sampling.top_p < 1.0:
        probs = _top_p(probs, sampling.top_p)
    return probs


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p`` (Holtzman et al. 2020)."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)  # (..., V)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of strictly more likely tokens
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs`` (..., V) -> (...,) long."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def sample_on_device(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """The draws of :func:`sample`, token for token and generator state for state, without reading anything back to
    the host: ``torch.multinomial`` draws one sample as argmax(p / E), E ~ Exp(1) per entry (the exponential race,
    equivalent to the Gumbel-max trick), but first checks p's validity with two host reads, which stall a CUDA loop
    that samples every step. Here p is not checked (a row of zeros gives token 0). (..., V) -> (...,) long."""
    noise = torch.empty_like(probs).exponential_(1, generator=generator)  # (..., V)
    return (probs / noise).argmax(-1)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...,) long: the index of each row's first largest entry (``torch.argmax``'s rule, so greedy
    decoding picks the same token). Float32 rows on the CPU go through NumPy's vectorized argmax: torch's CPU argmax
    (2.x) reads a 49,152-entry row ~8x slower, and a greedy step takes one per verified row."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.numel() and not logits.requires_grad:
        return torch.from_numpy(np.asarray(logits.numpy().argmax(-1), dtype=np.int64))
    return logits.argmax(-1)


def check_finite(logits: torch.Tensor, who: str) -> None:
    """Raise a clear error for NaN/inf logits instead of sampling garbage. One sum answers for finite rows (a NaN or
    inf makes it non-finite); only a non-finite sum, which huge finite logits could also give, reads every entry."""
    if not math.isfinite(logits.sum().item()) and not bool(torch.isfinite(logits).all()):
        _non_finite(who)


def _non_finite(who: str) -> NoReturn:
    raise SpecdraftError(f"non-finite logits (NaN or inf) from the {who} model")


def checked_argmax(logits: torch.Tensor, who: str) -> list[int]:
    """:func:`check_finite`, then each row's :func:`argmax` of ``logits`` (R, V), as a list. Float32 rows on the CPU,
    where the row kernels are loaded, are read once for both (a greedy step's logits come from memory, the LM head's
    weight stream having pushed them out of the caches: two passes cost about twice one)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1] \
            and not logits.requires_grad and rowgemm.loaded():
        best, finite = rowgemm.argmax_finite(logits)
        if not finite:
            _non_finite(who)
        return best.tolist()
    check_finite(logits, who)
    return argmax(logits).tolist()
