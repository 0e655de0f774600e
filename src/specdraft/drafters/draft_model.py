"""An independent draft model (Leviathan et al. 2023; Chen et al. 2023): a small causal LM sharing the target's
tokenizer drafts γ tokens autoregressively on its own KV cache and returns its distributions q.
"""

from __future__ import annotations

import torch

from specdraft.drafters.base import Draft
from specdraft.models.base import CausalLM, KVCache
from specdraft.sampling import SamplingConfig, check_finite, sample, warp
from specdraft.verification import VerifyResult


class DraftModelDrafter:
    """Draft with a small model. Its cache is synchronised to the context by longest common prefix, so rejected
    draft tokens are rolled back by a crop and the tokens the target added are fed in one forward."""

    def __init__(self, model: CausalLM, name: str | None = None) -> None:
        self.model = model
        self.name = name or f"draft:{model.name}"
        self.vocab_size = model.vocab_size
        self.max_context = model.max_context
        self._cache: KVCache | None = None
        self._cached = torch.empty(0, dtype=torch.long)  # (L,) ids whose keys/values are in the cache

    def _sync(self, context: torch.Tensor, num_draft_tokens: int) -> torch.Tensor:
        """Bring the cache to ``context[:-1]`` or further and return logits predicting the next token. (V,)"""
        needed = context.shape[0] + num_draft_tokens
        if self._cache is None or self._cache.capacity < needed:
            self._cache = self.model.new_cache(min(max(2 * needed, 256), self.model.max_context))
            self._cached = self._cached[:0]
        shared = min(self._cached.shape[0], context.shape[0] - 1)
        mismatch = (self._cached[:shared] != context[:shared]).nonzero()
        keep = int(mismatch[0]) if mismatch.numel() else shared
        self._cache.crop(keep)
        logits = self.model.forward(context[keep:].unsqueeze(0), self._cache)[0, -1]  # (V,)
        self._cached = context
        return logits

    @torch.inference_mode()
    def propose(
        self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Draft:
        logits = self._sync(context, num_draft_tokens)
        tokens, probs = [], []
        for i in range(num_draft_tokens):
            check_finite(logits, "draft")
            if sampling.greedy:
                token = logits.argmax(-1)
            else:
                probs.append(warp(logits, sampling))  # (V,)
                token = sample(probs[-1], generator)
            tokens.append(token)
            if i + 1 < num_draft_tokens:  # the last draft token is fed next step, only if accepted
                logits = self.model.forward(token.view(1, 1), self._cache)[0, -1]  # (V,)
        draft = torch.stack(tokens) if tokens else torch.empty(0, dtype=torch.long)  # (γ,)
        self._cached = torch.cat([context, draft[:-1]])
        return Draft(draft, torch.stack(probs) if probs else None)

    def begin(self, target, cache) -> None:
        pass

    def observe(self, result: VerifyResult) -> None:
        pass
