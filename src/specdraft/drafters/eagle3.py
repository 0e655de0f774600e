"""EAGLE-3 drafting (Li et al. 2025, arXiv 2503.01840) as a chain or an EAGLE-2 dynamic tree (arXiv 2406.16858).

The same feature stream and tree search as :mod:`specdraft.drafters.eagle`, with EAGLE-3's head
(:mod:`specdraft.heads.eagle3`): the loop hands over the target's residual stream entering the head's
``aux_layers`` (``target_features``: the decoding loop asks the verify forward for them, so there is no extra target
forward), which ``observe`` fuses with ``fc`` into the head's features; inside the tree a node's pair is (its
parent's output, its token), unfused. Tokens come from the head's own LM head over its draft vocabulary (``d2t``);
every other token gets q = 0 and is never drafted. ``top_k=1`` drafts a chain of ``num_draft_tokens`` tokens.
Lossless: verification uses the target's full distribution.

Weights (``quantize``): by default (``auto``) a float32 target's drafter multiplies on specdraft's int8 kernels (Q8_0
blocks of ``fc``, the midlayer's four projections and the LM head, :mod:`specdraft.models.quantized`) where they can
run: a draft step's few rows cost far less there than through fp32 GEMMs, the 8,192-row LM head most of all. Only
the drafts change; verification stays exact.
"""

from __future__ import annotations

import copy

import torch

from specdraft.drafters.base import TargetFeatures, check_feature_target, int8_drafting
from specdraft.drafters.eagle import EagleDrafter
from specdraft.drafters.loading import with_heads_defaults
from specdraft.drafters.options import build
from specdraft.errors import SpecdraftError
from specdraft.heads import load_heads
from specdraft.models import quantized
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
        quantize: ``auto`` (int8 kernels for a float32 target where they run, else the dense weights), ``int8`` or
            ``none``.
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

    def __init__(self, heads: str, top_k: int = 4, tree_nodes: int = 16, quantize: str = "auto") -> None:
        if not str(heads).strip():
            raise SpecdraftError("eagle3 needs heads=PATH: a folder made by `specdraft train-heads --kind eagle3`")
        _, head = load_heads(heads, kind="eagle3")
        self._setup(head, top_k, tree_nodes, quantize=quantize)

    @classmethod
    def from_module(cls, head, top_k: int = 4, tree_nodes: int = 16, keep: torch.Tensor | None = None,
                    quantize: str = "none") -> Eagle3Drafter:
        """A drafter over an in-memory :class:`~specdraft.heads.eagle3.Eagle3Head` (its weights as they are unless
        ``quantize``)."""
        drafter = cls.__new__(cls)
        drafter._setup(head, top_k, tree_nodes, keep, quantize)
        return drafter

    def _setup(self, head, top_k: int, tree_nodes: int, keep: torch.Tensor | None = None,
               quantize: str = "none") -> None:
        self.quantize = int8_drafting("eagle3", quantize)
        super()._setup(head, top_k, tree_nodes)
        self.hidden_layers = tuple(head.aux_layers)
        self._dense, self._int8 = self.head, None  # the head as given; its int8 copy, made on first use

    def target_features(self) -> TargetFeatures:
        """The residual stream entering the head's ``aux_layers`` of the target, concatenated."""
        return TargetFeatures(self.hidden_layers)

    def begin(self, target, cache) -> None:
        """A new generation: forget the feature stream; take the target's frozen embeddings."""
        embed, _ = target_weights(target)
        check_feature_target("EAGLE-3", target, embed, self.vocab_size, int(self.head.sizes["hidden_size"]),
                             self.hidden_layers, self.hidden_layers)
        if self.quantize and embed.dtype == torch.float32:
            self._int8 = self._int8 or int8_head(self._dense)
            self.head = self._int8
        else:
            self.head = self._dense.to(embed.dtype)
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


def int8_head(head):
    """A copy of an EAGLE-3 head whose products run on Q8_0 blocks: ``fc``, the midlayer's qkv, o, gate_up and down
    (:attr:`~specdraft.models.native_llama.DecoderLayer.quantized`) and the LM head; norms stay dense."""
    copied = copy.deepcopy(head)
    layer = copied.layer
    layer.quantized = {name: quantized.quantize(getattr(layer, f"{name}_weight").detach().float(), "q8_0")
                       for name in ("qkv", "o", "gate_up", "down")}
    copied.fc, copied.lm_head = quantized.Int8Linear(copied.fc), quantized.Int8Linear(copied.lm_head)
    return copied
