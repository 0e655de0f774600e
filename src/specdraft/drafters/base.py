"""The drafter interface: two verbs, as transformers' ``CandidateGenerator``.

``propose(context, num_draft_tokens, sampling, generator) -> Draft`` drafts up to ``num_draft_tokens`` tokens to
follow ``context``; ``observe(result)`` tells an adaptive drafter how verification went. The decoding loop knows
nothing else about a drafter, so a new drafting method is a new file behind this interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specdraft.sampling import SamplingConfig
from specdraft.verification import VerifyResult


@dataclass(frozen=True)
class Draft:
    """A drafted chain.

    tokens: (γ,) long ids, γ may be 0 (then the step is plain decoding).
    q: (γ, V) draft probabilities after the same warping as p, or None for a deterministic draft, which
       verification treats as a point mass on ``tokens``.
    """

    tokens: torch.Tensor
    q: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


EMPTY_DRAFT = Draft(torch.empty(0, dtype=torch.long))


@runtime_checkable
class Drafter(Protocol):
    """Anything that proposes draft tokens. ``vocab_size`` / ``max_context`` are None when unconstrained."""

    name: str
    vocab_size: int | None
    max_context: int | None

    def propose(
        self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Draft:
        """Draft at most ``num_draft_tokens`` tokens to follow ``context`` ((N,) long, the whole sequence so far)."""
        ...

    def observe(self, result: VerifyResult) -> None:
        """Feedback after verification (adaptive drafters use it; others ignore it)."""
        ...


class NoDrafter:
    """Proposes nothing: the decoding loop then runs plain autoregressive decoding, one target forward a token."""

    name = "ar"
    vocab_size = None
    max_context = None

    def propose(self, context, num_draft_tokens, sampling, generator) -> Draft:
        return EMPTY_DRAFT

    def observe(self, result: VerifyResult) -> None:
        pass
