"""EAGLE-3 drafting (Li et al. 2025, arXiv 2503.01840) as a chain or an EAGLE-2 dynamic tree (arXiv 2406.16858).

The same feature stream and tree search as :mod:`specdraft.drafters.eagle`, with EAGLE-3's head
(:mod:`specdraft.heads.eagle3`): the loop hands over the target's residual stream entering the head's
``aux_layers`` (``target_features``: the decoding loop asks the verify forward for them, so there is no extra target
forward), which ``observe`` fuses with ``fc`` into the head's features; inside the tree a node's pair is (its
parent's output, its token), unfused. Tokens come from the head's own LM head over its draft vocabulary (``d2t``);
every other token gets q = 0 and is never drafted. ``top_k=1`` drafts a chain of ``num_draft_tokens`` tokens.
Lossless: verification uses the target's full distribution.
"""

from __future__ import annotations

import torch

from specdraft.drafters.base import TargetFeatures
from specdraft.drafters.eagle import EagleDrafter
from specdraft.drafters.loading import with_heads_defaults
from specdraft.drafters.options import build
from specdraft.errors import SpecdraftError
from specdraft.heads import load_heads
from specdraft.models.registry import default_heads
from specdraft.models.shared_embeddings import target_weights
from specdraft.sampling import check_finite
from specdraft.verification import VerifyResult


class Eagle3Drafter(EagleDrafter):
    """Drafts with an EAGLE-3 head trained by ``specdraft train-heads --kind eagle3``.

    Args:
        heads: the heads folder (``<out>/heads``).
        top_k: children per expanded node and frontier nodes per level (EAGLE-2's k; 1: a chain).
        tree_nodes: nodes kept in the final tree (EAGLE-2's re-ranking).
    """

    name = "eagle3"

    method = "eagle3"

    @classmethod
    def from_options(cls, target, tokenizer, options: dict[str, str]) -> Eagle3Drafter:
        """``--drafter eagle3``: ``heads=PATH``, or without it the heads shipped for the target (SmolLM2-135M-Instruct:
        ``smollm2-135m-instruct-eagle3``), with the options the folder ships."""
        if "heads" not in options:
            options = {"heads": default_heads("eagle3", getattr(target, "name", ""))} | options
        return build(cls, with_heads_defaults(options, cls.method, cls.method))

    def __init__(self, heads: str, top_k: int = 4, tree_nodes: int = 16) -> None:
        if not str(heads).strip():
            raise SpecdraftError("eagle3 needs heads=PATH: a folder made by `specdraft train-heads --kind eagle3`")
        _, head = load_heads(heads, kind="eagle3")
        self._setup(head, top_k, tree_nodes)

    def _setup(self, head, top_k: int, tree_nodes: int, keep: torch.Tensor | None = None) -> None:
        super()._setup(head, top_k, tree_nodes)
        self.hidden_layers = tuple(head.aux_layers)

    def target_features(self) -> TargetFeatures:
        """The residual stream entering the head's ``aux_layers`` of the target, concatenated."""
        return TargetFeatures(self.hidden_layers)

    def begin(self, target, cache) -> None:
        """A new generation: forget the feature stream; take the target's frozen embeddings."""

        embed, _ = target_weights(target)
        hidden = int(self.head.sizes["hidden_size"])
        if tuple(embed.shape) != (self.vocab_size, hidden):
            raise SpecdraftError(f"EAGLE-3 head mismatch: trained for vocabulary {self.vocab_size} and hidden size "
                                 f"{hidden}, target {target.name!r} has embeddings {tuple(embed.shape)}")
        layers = getattr(getattr(target, "config", None), "num_hidden_layers", None)
        if layers is not None and max(self.hidden_layers) >= layers:
            raise SpecdraftError(f"EAGLE-3 head reads target layers {list(self.hidden_layers)}, target "
                                 f"{target.name!r} has {layers}")
        if self.head.dtype != embed.dtype:
            self.head.to(embed.dtype)
        self._embed = self._lm_head = embed.detach()
        self._ids = self.head.draft_token_ids  # (N,)
        self._cache = self._root = None
        self._features, self._received, self._fed = [], 0, 0

    @torch.inference_mode()
    def observe(self, result: VerifyResult) -> None:
        """Fuse the committed tokens' target features (F, kD) into head features (F, D) for the next ``propose``."""
        if result.hidden is not None and result.hidden.shape[0]:
            aux = result.hidden.detach().reshape(-1, result.hidden.shape[-1])  # (F, kD)
            self._features.append(self.head.fuse(aux))  # (F, D)
            self._received += int(aux.shape[0])

    def _logits(self, features: torch.Tensor) -> torch.Tensor:
        """(..., D) head outputs -> (..., V) float32 logits, -inf outside the draft vocabulary."""
        logits = self.head.logits(features).float()  # (..., N)
        check_finite(logits, "draft")
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))  # (..., V)
        return full.index_copy_(-1, self._ids, logits)
