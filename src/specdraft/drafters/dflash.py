"""DFlash drafting (Chen et al. 2026, arXiv 2602.06036): a whole block of draft tokens from one forward of a small
non-causal drafter conditioned on the target's features (:mod:`specdraft.heads.dflash`), as llama.cpp's
``draft-dflash`` drafts.

The feature stream. The loop hands over, after every step, the target's residual stream after the head's
``target_layer_ids`` of the tokens it fed and committed (``result.hidden``, (F, kD): the verify forward returns them,
so there is no extra target forward). With context x_0 .. x_{L-1} the drafter holds features of x_0 .. x_{L-2}
(x_{L-1}, the last committed token, is not fed yet). ``propose`` encodes the rows not yet cached into every draft
layer's context keys and values (the draft KV cache); only committed tokens ever enter it, so rejected drafts never
need rolling back, and the block's own keys are never cached.

The block. One forward over [x_{L-1}, MASK x (B - 1)] at positions L - 1 .. L + B - 2 gives B - 1 per-position
distributions q_1 .. q_{B-1}; the draft is the chain of its first ``num_draft_tokens`` (at most B - 1), whatever the
length costs one forward. Greedy: x_j = argmax q_j (q = None, a point mass). Sampling: x_j ~ q_j, each from its own
warped distribution (independent of x_1 .. x_{j-1}); verification accepts x_j with min(1, p(x_j | prefix) / q_j(x_j))
and resamples from norm(max(p - q_j, 0)), which is exact for any proposal distribution fixed before the draw
(Leviathan et al. 2023, Alg. 1), so the chain is lossless. ``confidence`` is each row's largest probability, read
before the draw, so adaptive speculation (:mod:`specdraft.speculation`) may cut the chain; the drafter's facts say
that one forward drafts any length, so the policy prices a draft at one forward's cost.

Weights (``quantize``): by default (``auto``) every linear of the drafter runs on specdraft's int8 kernels
(Q8_0 blocks, :mod:`specdraft.models.quantized`) where they can run: a block's few rows are far cheaper there than
through fp32 GEMMs (the 8,192-row LM head most of all). Only the drafts change; verification stays exact.

The first step of a generation has no features yet and proposes nothing (plain decoding).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from specdraft.drafters.base import EMPTY_DRAFT, Draft, DrafterFacts, ReadsTargetFeatures, TargetFeatures
from specdraft.drafters.loading import with_heads_defaults
from specdraft.drafters.options import build
from specdraft.errors import SpecdraftError
from specdraft.heads import load_heads
from specdraft.models import quantized
from specdraft.models.registry import default_heads
from specdraft.models.shared_embeddings import target_weights
from specdraft.sampling import SamplingConfig, argmax, check_finite, warp
from specdraft.verification import VerifyResult


class DFlashDrafter(ReadsTargetFeatures):
    """Drafts a block per forward with a DFlash head trained by ``specdraft train-heads --kind dflash``.

    Args:
        heads: the heads folder (``<out>/heads``) or the name of shipped heads.
        quantize: ``auto`` (int8 kernels where they run, else the dense weights), ``int8`` or ``none``.
    """

    name = "dflash"

    method = "dflash"
    facts = DrafterFacts(cpu_only=True, reads_target_features=True, one_forward_draft=True)

    @classmethod
    def from_options(cls, target, tokenizer, options: dict[str, str]) -> DFlashDrafter:
        """``--drafter dflash``: ``heads=PATH``, or without it the heads shipped for the target (SmolLM2-135M-Instruct:
        ``smollm2-135m-instruct-dflash``)."""
        if "heads" not in options:
            options = {"heads": default_heads("dflash", getattr(target, "name", ""))} | options
        return build(cls, with_heads_defaults(options, cls.method, cls.method))

    def __init__(self, heads: str, quantize: str = "auto") -> None:
        if not str(heads).strip():
            raise SpecdraftError("dflash needs heads=PATH: a folder made by `specdraft train-heads --kind dflash`")
        _, head = load_heads(heads, kind="dflash")
        self._setup(head, quantize)

    @classmethod
    def from_module(cls, head, quantize: str = "none") -> DFlashDrafter:
        """A drafter over an in-memory :class:`~specdraft.heads.dflash.DFlashHead` (its weights as they are unless
        ``quantize``)."""
        drafter = cls.__new__(cls)
        drafter._setup(head, quantize)
        return drafter

    def _setup(self, head, quantize: str) -> None:
        if quantize not in ("auto", "int8", "none"):
            raise SpecdraftError(f"dflash option quantize must be auto, int8 or none, got {quantize!r}")
        if quantize == "int8" and not quantized.available():
            raise SpecdraftError("dflash quantize=int8 needs specdraft's int8 kernels, which cannot run here (an x86 "
                                 "CPU with AVX2, FMA and F16C and a C++ compiler)")
        self.quantize = quantize == "int8" or (quantize == "auto" and quantized.available())
        self.head = head.eval()
        self._run = None  # the head that drafts: ``head`` in the target's dtype, or its int8 copy
        self.vocab_size = int(head.spec["vocab_size"])
        self.max_context = int(head.spec["max_position_embeddings"])
        self.hidden_layers = tuple(i + 1 for i in head.target_layer_ids)  # inputs of the next layers
        self._embed = None
        self._reset()

    def _reset(self) -> None:
        self._features: list[torch.Tensor] = []
        self._received, self._fed = 0, 0  # feature rows observed; rows in the draft KV cache
        self._keys: list[torch.Tensor] = []  # per layer (1, K, capacity, hd)
        self._values: list[torch.Tensor] = []

    def target_features(self) -> TargetFeatures:
        """The residual stream after the head's ``target_layer_ids`` (entering the next layers), concatenated."""
        return TargetFeatures(self.hidden_layers)

    def begin(self, target, cache) -> None:
        """A new generation: forget the feature stream and the draft KV cache; take the target's embeddings."""
        embed, _ = target_weights(target)
        hidden = int(self.head.spec["hidden_size"])
        if tuple(embed.shape) != (self.vocab_size, hidden):
            raise SpecdraftError(f"DFlash head mismatch: trained for vocabulary {self.vocab_size} and hidden size "
                                 f"{hidden}, target {getattr(target, 'name', '?')!r} has embeddings "
                                 f"{tuple(embed.shape)}")
        layers = getattr(getattr(target, "config", None), "num_hidden_layers", None)
        if layers is not None and max(self.hidden_layers) >= layers:
            raise SpecdraftError(f"DFlash head reads target layers {self.head.target_layer_ids}, target "
                                 f"{getattr(target, 'name', '?')!r} has {layers}")
        if self.head.dtype != embed.dtype:
            self.head.to(embed.dtype)
            self._run = None
        if self._run is None:
            self._run = int8_head(self.head) if self.quantize else self.head
        self._embed = embed.detach()
        self._ids = self.head.d2t  # (V_d,)
        self._reset()

    def observe(self, result: VerifyResult) -> None:
        """Keep the committed tokens' target features (F, kD); ``propose`` encodes them into the draft KV cache."""
        if result.hidden is not None and result.hidden.shape[0]:
            self._features.append(result.hidden.detach().reshape(-1, result.hidden.shape[-1]))
            self._received += int(result.hidden.shape[0])

    @torch.inference_mode()
    def propose(self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        if self._received == 0 or num_draft_tokens < 1:
            return EMPTY_DRAFT  # the first step: no features yet
        self._sync(context)
        logits = self._block(context, min(num_draft_tokens, self.head.block_size - 1))  # (n, V_d)
        if sampling.greedy:  # the draft vocabulary's argmax and softmax are the full vocabulary's
            best = argmax(logits)  # (n,)
            confidence = torch.softmax(logits, -1).gather(-1, best[:, None])[:, 0]  # (n,)
            return Draft(self._ids[best], None, confidence=confidence)
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))  # (n, V)
        probs = warp(full.index_copy_(-1, self._ids, logits), sampling)  # (n, V): q_j, 0 outside the draft vocab
        tokens = torch.multinomial(probs, 1, generator=generator).flatten()  # (n,): x_j ~ q_j
        return Draft(tokens, probs, confidence=probs.max(-1).values)

    def _sync(self, context: torch.Tensor) -> None:
        """Encode the feature rows not yet in the draft KV cache into every layer's keys and values."""
        if self._embed is None:
            raise SpecdraftError("DFlashDrafter.begin(target, cache) must be called before propose")
        if self._received != context.shape[0] - 1:
            raise SpecdraftError(f"DFlash drafter holds features of {self._received} tokens but the context has "
                                 f"{context.shape[0]} (expected one more: the last token is not fed yet)")
        if self._fed == self._received:
            return
        pending = torch.cat(self._features) if len(self._features) > 1 else self._features[0]  # (F, kD)
        self._features = []  # only rows not yet encoded are kept
        g = self._run.encode(pending)[None]  # (1, F, D)
        positions = torch.arange(self._fed, self._received)  # (F,)
        new = self._run.context(g, positions)  # per layer (1, K, F, hd) twice
        if not self._keys or self._keys[0].shape[2] < self._received:
            capacity = min(max(2 * self._received, 256), max(self.max_context, self._received))
            self._keys = [self._grown(k, capacity) for k in self._keys] or [
                k.new_zeros(*k.shape[:2], capacity, k.shape[3]) for k, _ in new]
            self._values = [self._grown(v, capacity) for v in self._values] or [
                v.new_zeros(*v.shape[:2], capacity, v.shape[3]) for _, v in new]
        for layer, (key, value) in enumerate(new):
            self._keys[layer][:, :, self._fed : self._received] = key
            self._values[layer][:, :, self._fed : self._received] = value
        self._fed = self._received

    def _grown(self, cache: torch.Tensor, capacity: int) -> torch.Tensor:
        """(1, K, C, hd) -> (1, K, capacity, hd) holding the same first ``self._fed`` rows."""
        grown = cache.new_zeros(*cache.shape[:2], capacity, cache.shape[3])
        grown[:, :, : self._fed] = cache[:, :, : self._fed]
        return grown

    def _block(self, context: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """One forward over [x_{L-1}, MASK x (B-1)]: the first ``rows`` (default all B - 1) draft positions' float32
        logits over the draft vocabulary, (rows, V_d); the LM head reads only those rows."""
        n = context.shape[0] - 1
        h = self._run.block_embeddings(context[-1:], self._embed)  # (1, B, D)
        positions = torch.arange(n, n + self.head.block_size)  # (B,)
        kv = [(k[:, :, :n], v[:, :, :n]) for k, v in zip(self._keys, self._values, strict=True)]
        hidden = self._run(h, positions, kv)[0, 1 : 1 + (rows or self.head.block_size - 1)]  # (rows, D)
        logits = self._run.logits(hidden).float()  # (rows, V_d)
        check_finite(logits, "draft")
        return logits


class Int8Linear(nn.Module):
    """A linear layer on Q8_0 blocks (:func:`specdraft.models.quantized.linear`): (..., K) -> (..., N) in x's dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = quantized.quantize(linear.weight.detach().float(), "q8_0")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized.linear(x.contiguous(), self.weight).to(x.dtype)


def int8_head(head: nn.Module) -> nn.Module:
    """A copy of ``head`` whose every linear layer runs on int8 kernels (norms and the mask vector stay dense)."""
    copied = copy.deepcopy(head)
    for name, module in list(copied.named_modules()):
        if isinstance(module, nn.Linear):
            parent, _, attribute = name.rpartition(".")
            setattr(copied.get_submodule(parent) if parent else copied, attribute, Int8Linear(module))
    return copied
