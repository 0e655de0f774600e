"""A frequency-ranked draft vocabulary for drafters that end in a large LM head (FR-Spec, Zhao et al.
2025, "FR-Spec: Accelerating Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling",
arXiv 2502.14856).

Medusa and EAGLE heads turn features into tokens with the target's LM head, a V x D matrix. For a small target with
a large vocabulary that matrix is a big share of the whole model (SmolLM2-135M: 28M of 135M parameters), so one
draft step that multiplies by it costs a fifth of a target step on a memory-bound CPU. FR-Spec restricts the draft
to the N most frequent tokens: the draft logits are W[keep] f (N rows), and every other token gets logit -inf
(q = 0), so it is never drafted. Verification still uses the target's full distribution, so the output is unchanged
(a deterministic draft is verified as a point mass; a sampled one by the usual rule with q = 0 outside the subset).

An independent draft model benefits the same way: a small drafter with a tied 49k-token embedding spends most of
its draft step in that product (:class:`~specdraft.drafters.draft_model.DraftModelDrafter`, ``draft_vocab``).

The ranking is the token frequency of the heads' (or drafter's) training data (the target's own responses), stored
next to their weights as ``token_ranking.safetensors`` (``token_ids``: a permutation of the vocabulary, most
frequent first, ties by id).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from specdraft.errors import SpecdraftError
from specdraft.sampling import check_finite

RANKING_FILE = "token_ranking.safetensors"


def rank_tokens(sequences: Iterable[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """Token ids (V,) by descending count over ``sequences``, ties (and unseen tokens) in id order."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in sequences:
        if len(ids):
            counts += torch.bincount(torch.as_tensor(ids, dtype=torch.long), minlength=vocab_size)[:vocab_size]
    return torch.argsort(-counts, stable=True)  # (V,)


def save_token_ranking(folder: str | Path, ranking: torch.Tensor) -> Path:
    """Write ``ranking`` (V,) into ``folder`` as :data:`RANKING_FILE`."""
    from safetensors.torch import save_file

    path = Path(folder) / RANKING_FILE
    save_file({"token_ids": ranking.to(torch.long).contiguous()}, str(path))
    return path


def load_token_ranking(folder: str | Path, vocab_size: int) -> torch.Tensor:
    """The stored ranking (V,), checked to be a permutation of the vocabulary."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(folder) / RANKING_FILE
    if not path.is_file():
        raise SpecdraftError(f"{folder} has no {RANKING_FILE}: a draft_vocab needs the token ranking of the "
                             "training data, stored by this version of `specdraft finetune` and `train-heads`")
    try:
        ranking = load_file(str(path))["token_ids"]
    except (OSError, SafetensorError, KeyError, ValueError) as exc:
        raise SpecdraftError(f"corrupt token ranking {path}: {str(exc).splitlines()[0][:200]}") from None
    if ranking.shape != (vocab_size,) or not torch.equal(torch.sort(ranking).values, torch.arange(vocab_size)):
        raise SpecdraftError(f"{path} is not a ranking of the {vocab_size}-token vocabulary")
    return ranking


class DraftVocab:
    """Draft logits through the target's LM head, over the full vocabulary or a frequency-ranked subset.

    Args:
        lm_head: (V, D) the target's LM head weight (kept, not copied, when ``keep`` is None).
        keep: (N,) token ids the draft may propose (None: all V).
        quantize: ``int8`` rounds the (subset's) rows once to Q8_0 blocks and multiplies with specdraft's int8
            kernels (CPU): a draft-side rounding, so output stays lossless; None (or no kernels here): dense.
    """

    def __init__(self, lm_head: torch.Tensor, keep: torch.Tensor | None = None, quantize: str | None = None) -> None:
        from specdraft.models import quantized

        self.vocab_size = int(lm_head.shape[0])
        self.keep = None if keep is None or keep.numel() >= self.vocab_size else keep.to(torch.long)
        self.weight = lm_head if self.keep is None else lm_head[self.keep].contiguous()  # (N, D)
        usable = quantize is not None and self.weight.device.type == "cpu" and quantized.available()
        kind = {"int8": "q8_0", "int4": "q4_0"}.get(str(quantize), quantize)
        self.packed = quantized.quantize(self.weight, kind) if usable else None

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """(..., D) features -> (..., V) float32 logits, -inf outside the subset."""
        if self.packed is not None:
            from specdraft.models.quantized import linear

            return self.expand(linear(features.float().contiguous(), self.packed))  # (..., V)
        return self.expand(F.linear(features.to(self.weight.dtype), self.weight))  # (..., V)

    def expand(self, logits: torch.Tensor) -> torch.Tensor:
        """Subset logits (..., N) -> (..., V) float32 with -inf outside the subset (checked finite first)."""
        logits = logits.float()
        check_finite(logits, "draft")
        if self.keep is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))  # (..., V)
        return full.index_copy_(-1, self.keep, logits)


def draft_subset(heads: str | Path, vocab_size: int, draft_vocab: int | str) -> torch.Tensor | None:
    """The ``draft_vocab`` most frequent token ids (N,) of a heads (or draft model) folder's ranking; None for 0 or
    the whole vocabulary (no restriction). ``draft_vocab`` may be an option string."""
    from specdraft.models.registry import resolve_heads

    try:
        draft_vocab = int(draft_vocab) if isinstance(draft_vocab, str) else draft_vocab
    except ValueError:
        pass  # refused just below, with the value in the message
    if not isinstance(draft_vocab, int) or draft_vocab < 0:
        raise SpecdraftError(f"draft_vocab must be an integer >= 0 (0 = the whole vocabulary), got {draft_vocab!r}")
    if draft_vocab == 0 or draft_vocab >= vocab_size:
        return None
    return load_token_ranking(resolve_heads(str(heads)), vocab_size)[:draft_vocab]
