"""Prompt lookup decoding (Saxena 2023; LLMA, Yang et al. 2023): draft by copying what followed the most recent
earlier occurrence of the context's last n-gram. Training-free and deterministic (q = None, a point mass).

The n-grams are indexed incrementally (a dict per size from n-gram to the starts of its occurrences that have a
successor), kept in step with the context by its longest common prefix with the last one seen: a step costs the
few tokens it added or rolled back, not a scan of the whole context (three scans of a few hundred tokens in torch,
each policy query and draft, cost about 0.15 ms a step, a few per cent of a step of SmolLM2)."""

from __future__ import annotations

import torch

from specdraft.drafters.base import EMPTY_DRAFT, Draft, DrafterFacts, common_prefix
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
        self._seen = torch.empty(0, dtype=torch.long)  # (L,) the context indexed
        self._tokens: list[int] = []  # the same as a list
        self._starts: dict[int, dict[tuple[int, ...], list[int]]] = {}  # n -> n-gram -> starts with a successor

    def propose(
        self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Draft:
        return self.match(context, num_draft_tokens)[1]

    def draft_kind(self, context: torch.Tensor, sampling: SamplingConfig) -> int:
        """The size of the n-gram a draft would copy after (0: nothing to copy)."""
        return self.match(context, 1)[0]

    def match(self, context: torch.Tensor, num_draft_tokens: int) -> tuple[int, Draft]:
        """(n, draft): the size of the longest matched n-gram (0 for none) and the copied continuation."""
        if context.shape[0] != self._seen.shape[0] or not torch.equal(context, self._seen):  # a step asks twice
            self._sync(context)  # (its kind, then its draft) about one context: the second time, nothing to index
        length, tokens = len(self._tokens), self._tokens
        for n in range(min(self.max_ngram_size, length - 1), self.min_ngram_size - 1, -1):
            starts = self._starts.get(n, {}).get(tuple(tokens[length - n :]))
            if starts:
                start = starts[-1] + n  # most recent earlier occurrence
                copied = context[start : start + num_draft_tokens].clone()  # (γ,)
                return n, Draft(copied, source=torch.full_like(copied, n))  # acceptance is learned per n
        return 0, EMPTY_DRAFT

    def _sync(self, context: torch.Tensor) -> None:
        """Index ``context`` (N,): roll back to its longest common prefix with the last one, then add its rest. The
        n-gram starting at i is indexed once it has a successor (i + n <= N - 1), its starts in increasing order."""
        seen = self._seen.shape[0]
        common = common_prefix(self._seen, context)
        sizes = range(self.min_ngram_size, self.max_ngram_size + 1)
        for n in sizes:  # drop the starts whose n-gram or successor lies past the common prefix, latest first
            table = self._starts.setdefault(n, {})
            for i in range(seen - n - 1, max(0, common - n) - 1, -1):
                key = tuple(self._tokens[i : i + n])
                table[key].pop()
                if not table[key]:
                    del table[key]
        del self._tokens[common:]
        self._tokens += context[common:].tolist()
        length = len(self._tokens)
        for n in sizes:
            table = self._starts[n]
            for i in range(max(0, common - n), length - n):
                table.setdefault(tuple(self._tokens[i : i + n]), []).append(i)
        self._seen = context.clone()  # (a caller may reuse its buffer)

    def begin(self, target, cache) -> None:
        pass

    def observe(self, result: VerifyResult) -> None:
        pass
