"""Prompt lookup decoding (Saxena 2023; LLMA, Yang et al. 2023): draft by copying what followed the most recent
earlier occurrence of the context's last n-gram. Training-free and deterministic (q = None, a point mass)."""

from __future__ import annotations

import torch

from specdraft.drafters.base import EMPTY_DRAFT, Draft, DrafterFacts
from specdraft.errors import SpecdraftError
from specdraft.sampling import SamplingConfig
from specdraft.verification import VerifyResult


class PromptLookupDrafter:
    """n-gram match in the context, longest n first (``max_ngram_size`` down to ``min_ngram_size``)."""

    name = "prompt-lookup"
    vocab_size = None
    max_context = None

    method = "prompt-lookup"
    facts = DrafterFacts(replayable=True)

    def __init__(self, max_ngram_size: int = 3, min_ngram_size: int = 1) -> None:
        if not 1 <= min_ngram_size <= max_ngram_size:
            raise SpecdraftError(f"need 1 <= min_ngram_size <= max_ngram_size, got {min_ngram_size}, {max_ngram_size}")
        self.max_ngram_size = max_ngram_size
        self.min_ngram_size = min_ngram_size

    def propose(
        self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Draft:
        return self.match(context, num_draft_tokens)[1]

    def draft_kind(self, context: torch.Tensor, sampling: SamplingConfig) -> int:
        """The size of the n-gram a draft would copy after (0: nothing to copy)."""
        return self.match(context, 1)[0]

    def match(self, context: torch.Tensor, num_draft_tokens: int) -> tuple[int, Draft]:
        """(n, draft): the size of the longest matched n-gram (0 for none) and the copied continuation."""
        length = context.shape[0]
        for n in range(min(self.max_ngram_size, length - 1), self.min_ngram_size - 1, -1):
            windows = context[: length - 1].unfold(0, n, 1)  # (length - n, n): n-grams that have a successor
            hits = (windows == context[length - n :]).all(-1).nonzero()  # (h, 1) start positions
            if hits.numel():
                start = int(hits[-1]) + n  # most recent earlier occurrence
                copied = context[start : start + num_draft_tokens].clone()  # (γ,)
                return n, Draft(copied, source=torch.full_like(copied, n))  # acceptance is learned per n
        return 0, EMPTY_DRAFT

    def begin(self, target, cache) -> None:
        pass

    def observe(self, result: VerifyResult) -> None:
        pass
