"""Big Little Decoder (BiLD; Kim et al. 2023, *Speculative Decoding with Big Little Decoder*, NeurIPS, arXiv
2302.07863). **Lossy by design**: the output is not the target's own unless the rollback threshold is 0.

A small model (the *little* decoder, here a draft model) generates alone while it is sure of itself; the large model
(the target) runs only when it is not, over all the small model's new tokens at once, and corrects them:

- **fallback policy** (Sec. 3.2): the small model stops at the first position where its largest probability
  max_y q(y) is below the fallback threshold α_FB; the large model writes that position's token (the step's
  recovered or bonus token). Here a step also ends after ``num_draft_tokens`` small-model tokens (the speculation
  policy's budget), so the large model runs at least that often.
- **rollback policy** (Sec. 3.3): the large model rolls back the small model's tokens from the first one whose
  distance d = -log p(token) (the cross-entropy of the small model's hard label under the large model's
  distribution) exceeds the rollback threshold α_RB, and writes its own token there.

Departure from the paper: a token the exact test keeps (greedy: the target's own argmax) is never rolled back. In
the paper such a token is rolled back when p(token) < e^-α_RB, and the large model writes the same token back (it
only discards the rest of the draft). With it, α_RB = 0 keeps exactly what lossless verification keeps: greedy
output equals plain decoding, and sampled output follows the target (speculative sampling). Larger α_RB keeps more
of the small model's tokens (more tokens per large-model forward) at the cost of answers that can differ.

The draft carries α_RB (:attr:`~specdraft.drafters.base.Draft.rollback`), and verification applies it
(:func:`specdraft.verification.within_rollback`); the decoding loop is the one every drafter uses.
"""

from __future__ import annotations

import torch

from specdraft.drafters.base import Draft, DrafterFacts
from specdraft.drafters.draft_model import DraftModelDrafter
from specdraft.drafters.loading import on_draft_model
from specdraft.errors import SpecdraftError
from specdraft.models.base import CausalLM
from specdraft.sampling import SamplingConfig, sample, warp


class BiLDDrafter(DraftModelDrafter):
    """BiLD's small model (module docstring): drafts while its largest probability is at least ``fallback``
    (α_FB in [0, 1]; 0: always the whole budget) and asks verification to keep tokens within ``rollback`` (α_RB >= 0,
    nats; 0: exact). ``keep``: a draft vocabulary, as for :class:`DraftModelDrafter`. Counter: ``fallbacks``, steps
    ended by the fallback policy rather than the budget."""

    method = "bild"
    facts = DrafterFacts()  # lossy acceptance: greedy replay's exact match would misstate its τ

    @classmethod
    def from_options(cls, target, tokenizer, options: dict[str, str]) -> BiLDDrafter:
        """``--drafter bild``: its small model is the draft model ``draft=NAME`` (default: the target's shipped
        drafter)."""
        return on_draft_model(cls, "bild", target, tokenizer, options)

    def __init__(self, model: CausalLM, name: str | None = None, fallback: float = 0.5, rollback: float = 2.0, *,
                 keep: torch.Tensor | None = None) -> None:
        if not 0.0 <= fallback <= 1.0:
            raise SpecdraftError(f"bild fallback must be in [0, 1] (the small model's largest probability below "
                                 f"which the large model takes over), got {fallback}")
        if not rollback >= 0.0:
            raise SpecdraftError(f"bild rollback must be >= 0 (nats of -log p; 0 = exact), got {rollback}")
        super().__init__(model, name, keep=keep)
        self.fallback, self.rollback = float(fallback), float(rollback)
        self.fallbacks = 0

    @torch.inference_mode()
    def propose(
        self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Draft:
        """The small model's tokens after ``context`` (N,) until its largest probability drops below ``fallback``
        (that position is left to the large model) or ``num_draft_tokens`` are drafted."""
        logits = self._sync(context, num_draft_tokens)  # (V,) after the whole context
        tokens, rows, confidence = [], [], []
        for i in range(num_draft_tokens):
            probs = torch.softmax(logits.float(), -1) if sampling.greedy else warp(logits, sampling)  # (V,)
            top = probs.max()
            if float(top) < self.fallback:
                self.fallbacks += 1
                break
            tokens.append(probs.argmax(-1) if sampling.greedy else sample(probs, generator))
            rows.append(probs)
            confidence.append(top)
            if i + 1 < num_draft_tokens:
                logits = self._forward(tokens[-1].view(1, 1), logits_to_keep=1)[0, -1]  # (V,)
        draft = torch.stack(tokens) if tokens else torch.empty(0, dtype=torch.long)  # (γ,)
        fed = len(tokens) if len(tokens) < num_draft_tokens else len(tokens) - 1  # the last token is fed next step
        self._cached = torch.cat([context, draft[:fed]])
        q = None if sampling.greedy or not tokens else torch.stack(rows)  # (γ, V)
        sure = torch.stack(confidence).float() if tokens else torch.empty(0)  # (γ,)
        return Draft(draft, q, confidence=sure, rollback=self.rollback)
