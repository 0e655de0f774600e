"""Block-quantized linear weights (GGUF's Q4_0, Q4_1 and Q8_0) multiplied as they ship, with int8 dot products.

A GGUF model stores each weight row in blocks of 32: Q4_1 as an fp16 scale, an fp16 minimum and 4-bit quants
(w = d q + m), Q4_0 as a scale and 4-bit quants (w = d (q - 8)), Q8_0 as a scale and int8 quants (w = d q).
SmolLM2-135M-Instruct ships its layers in Q4_1 and its embedding (the tied LM head) in Q8_0: 96 MB read per token
instead of 270 MB for the bf16 copy that dequantizing it would make, and the products use the published weights
rather than a rounding of them. :func:`linear` quantizes the input rows to int8 per block of 32 (as llama.cpp does)
and multiplies with exact integer dot products (``quantgemm.cpp``: AVX-512 VNNI where the CPU and torch's dispatch
have it, AVX2 elsewhere, bit-identical results); each output element is one fixed sequence of fp32 operations, so a
k-token forward reproduces k 1-token forwards bit for bit, on any number of threads.

Weights are packed once (:func:`pack_blocks`) into groups of 16 output columns, the layout the kernel streams;
:func:`quantize` makes the same blocks from a dense weight (``--quantize``: lossy with respect to that weight).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch

import specdraft.models.rowgemm as rowgemm
from specdraft.errors import SpecdraftError
from specdraft.hardware import cpu_capability, cpu_flags

Q4_0, Q4_1, Q8_0 = 2, 3, 8  # ggml's type ids
KINDS = {"q4_0": Q4_0, "q4_1": Q4_1, "q8_0": Q8_0}
NAMES = {kind: name for name, kind in KINDS.items()}
BLOCK = 32  # weights per block
GROUP = 16  # output columns per packed group
_RAW_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}  # one GGUF block
_PACKED_BYTES = {Q4_0: 32 + 256, Q4_1: 64 + 256, Q8_0: 32 + 512}  # one group's block (quantgemm.cpp)
_VNNI_ENV = "SPECDRAFT_QUANT_VNNI"  # "0" keeps the AVX2 kernel on an AVX-512 VNNI CPU (comparisons)


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear weight (N, K) in blocks of 32, packed for :func:`linear`: ``packed`` is (ceil(N / 16), K / 32,
    bytes) uint8, ``kind`` a ggml type id (:data:`Q4_0`, :data:`Q4_1`, :data:`Q8_0`)."""

    kind: int
    packed: torch.Tensor
    out_features: int
    in_features: int

    @property
    def name(self) -> str:
        return NAMES[self.kind]

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


def available() -> bool:
    """Whether the quantized kernels can run here (they are built with the row kernels: x86 with AVX2, FMA, F16C)."""
    return rowgemm.available()


@functools.cache
def mode() -> int:
    """1: the AVX-512 VNNI kernel (torch dispatches to AVX-512 and the CPU has VNNI); 0: the AVX2 kernel. Both give
    identical results; ``ATEN_CPU_CAPABILITY=avx2`` or ``SPECDRAFT_QUANT_VNNI=0`` keeps 0."""
    if os.environ.get(_VNNI_ENV, "1") == "0" or not cpu_capability().startswith("AVX512"):
        return 0
    return 1 if {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"} <= cpu_flags() else 0


@functools.cache
def _ops():
    """The kernels' op namespace, built on first use; a SpecdraftError where they cannot run."""
    if not rowgemm.available():
        raise SpecdraftError("quantized weights need specdraft's C++ kernels: an x86 CPU with AVX2, FMA and F16C, "
                             "a C++ compiler, and SPECDRAFT_ROWGEMM not 0 (or give --dtype to decode dense weights)")
    return torch.ops.specdraft_rowgemm


def _check_shape(kind: int, out_features: int, in_features: int) -> None:
    if kind not in _RAW_BYTES:
        raise SpecdraftError(f"unsupported quantization type {kind}: specdraft runs Q4_0, Q4_1 and Q8_0")
    if in_features % BLOCK or out_features < 1:
        raise SpecdraftError(f"a quantized weight needs rows of a multiple of {BLOCK} values, got {in_features}")


def pack_blocks(raw: torch.Tensor, kind: int, out_features: int, in_features: int) -> QuantizedWeight:
    """GGUF blocks (N, K / 32 * block bytes) uint8, row n being output feature n, packed for :func:`linear`.

    Groups of 16 rows (the last zero-padded: scale 0); for each group and block the 16 scales, (Q4_1) the 16 minima,
    then the quants in 64-byte chunks whose 32-bit lane j holds row j's 4 consecutive quant bytes.
    """
    _check_shape(kind, out_features, in_features)
    blocks = in_features // BLOCK
    raw = raw.reshape(out_features, blocks, _RAW_BYTES[kind])
    groups = -(-out_features // GROUP)
    padded = torch.zeros(groups * GROUP, blocks, _RAW_BYTES[kind], dtype=torch.uint8)
    padded[:out_features] = raw
    by_group = padded.view(groups, GROUP, blocks, -1).permute(0, 2, 1, 3)  # (G, nb, 16, bytes)
    scales = by_group[..., 0:2].reshape(groups, blocks, 32)  # 16 fp16 scales
    parts = [scales]
    if kind == Q4_1:
        parts.append(by_group[..., 2:4].reshape(groups, blocks, 32))  # 16 fp16 minima
    quants = by_group[..., _RAW_BYTES[kind] - (32 if kind == Q8_0 else 16):]  # (G, nb, 16, 32 or 16)
    if kind == Q8_0:
        quants = quants + 128  # int8 -> biased u8 (wraps exactly in uint8 arithmetic)
    chunks = quants.shape[-1] // 4
    # (G, nb, 16 rows, chunks, 4 bytes) -> (G, nb, chunks, 16 rows, 4 bytes): lane j of chunk t = row j's bytes 4t..4t+3
    parts.append(quants.reshape(groups, blocks, GROUP, chunks, 4).transpose(2, 3).reshape(groups, blocks, -1))
    packed = torch.cat(parts, dim=-1).contiguous()  # (G, nb, packed bytes)
    return QuantizedWeight(kind, packed, out_features, in_features)


def quantize(weight: torch.Tensor, kind: int | str) -> QuantizedWeight:
    """A dense weight (N, K) rounded to GGUF blocks (gguf-py's reference quantizers, as llama.cpp's
    ``llama-quantize`` without an importance matrix) and packed: lossy with respect to ``weight``."""
    import gguf

    kind = KINDS[kind] if isinstance(kind, str) else kind
    out_features, in_features = weight.shape
    _check_shape(kind, out_features, in_features)
    array = weight.detach().to(torch.float32).cpu().numpy()
    blocks = gguf.quants.quantize(array, gguf.GGMLQuantizationType(kind))  # (N, K / 32 * block bytes) uint8
    return pack_blocks(torch.from_numpy(np.ascontiguousarray(blocks)), kind, out_features, in_features)


def linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """``x @ w.T`` for x (..., K) in fp32 or bf16: (..., N) fp32. Each input row is quantized to int8 per block."""
    return _ops().qlinear(x, weight.packed, weight.kind, weight.out_features, mode())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x (..., D) float32 times ``weight`` (D,), each row with the fused layer's arithmetic (one
    left-to-right sum of squares per row): (..., D) float32."""
    return _ops().qnorm(x, weight, eps)


class Int8Linear(torch.nn.Module):
    """An ``nn.Linear`` (no bias) whose product runs on Q8_0 blocks of its weight (:func:`linear`): (..., K) ->
    (..., N) in x's dtype. ``weight`` stays the dense weight, for callers that read its shape or dtype."""

    def __init__(self, dense: torch.nn.Linear) -> None:
        super().__init__()
        if dense.bias is not None:
            raise SpecdraftError("Int8Linear takes a linear layer without a bias")
        self.weight = dense.weight
        self.blocks = quantize(dense.weight.detach().float(), "q8_0")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x.contiguous(), self.blocks).to(x.dtype)


def rows(weight: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (any shape) of the weight dequantized exactly to fp32: (*ids.shape, K). An embedding lookup."""
    out = _ops().qrows(weight.packed, weight.kind, weight.in_features, weight.out_features, ids)
    return out.view(*ids.shape, weight.in_features)


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The whole weight (N, K) in fp32, exactly as the blocks define it."""
    return rows(weight, torch.arange(weight.out_features))


@dataclass(frozen=True)
class FusedLayer:
    """What one fused decoder-layer call needs besides the activations and the cache (``quantlayer.cpp``)."""

    weights: list[torch.Tensor]  # packed qkv, o, gate_up, down
    kinds: list[int]
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    eps: float
    heads: int
    kv_heads: int
    q_norm: torch.Tensor | None = None  # (hd,) Qwen3's per-head norms of queries and keys; None in a Llama layer
    k_norm: torch.Tensor | None = None

    @classmethod
    def of(cls, layer) -> FusedLayer:
        """The fused call's arguments for a decoder layer whose ``quantized`` dict holds its four projections."""
        names = ("qkv", "o", "gate_up", "down")
        return cls([layer.quantized[n].packed for n in names], [layer.quantized[n].kind for n in names],
                   layer.attn_norm.detach(), layer.mlp_norm.detach(), float(layer.eps), layer.num_heads,
                   layer.num_kv_heads)


@dataclass(frozen=True)
class FusedStack:
    """A model's fused layers flattened for one :func:`fused_layers` call: their weights and kinds in layer order, four
    per layer, and their norms (q_norms and k_norms empty in a Llama)."""

    weights: list[torch.Tensor]
    kinds: list[int]
    attn_norms: list[torch.Tensor]
    mlp_norms: list[torch.Tensor]
    q_norms: list[torch.Tensor]
    k_norms: list[torch.Tensor]
    eps: float
    heads: int
    kv_heads: int

    @classmethod
    def of(cls, layers: list[FusedLayer | None]) -> FusedStack | None:
        """The stack of ``layers``; None where one call cannot run them all (a layer not fused, layers that differ in
        eps or heads, q and k norms on only some)."""
        if not layers or any(layer is None for layer in layers):
            return None
        first = layers[0]
        if any((layer.eps, layer.heads, layer.kv_heads, layer.q_norm is None, layer.k_norm is None)
               != (first.eps, first.heads, first.kv_heads, first.q_norm is None, first.k_norm is None)
               for layer in layers) or (first.q_norm is None) != (first.k_norm is None):
            return None
        normed = first.q_norm is not None
        return cls([w for layer in layers for w in layer.weights], [k for layer in layers for k in layer.kinds],
                   [layer.attn_norm for layer in layers], [layer.mlp_norm for layer in layers],
                   [layer.q_norm for layer in layers] if normed else [],
                   [layer.k_norm for layer in layers] if normed else [], first.eps, first.heads, first.kv_heads)


def fused_layers(hidden: torch.Tensor, stack: FusedStack, keys: list[torch.Tensor], values: list[torch.Tensor],
                 start: int, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """:func:`fused_layer` for every layer of ``stack`` in turn, in one call (one dispatch instead of one per layer):
    hidden (1, T, D) float32 -> (1, T, D), layer l writing into ``keys[l]`` / ``values[l]`` (1, KV, S, hd). Equal bit
    for bit to the calls one by one."""
    return _ops().qlayers(hidden, stack.weights, stack.kinds, stack.attn_norms, stack.mlp_norms, stack.eps, keys,
                          values, start, cos, sin, mask, stack.heads, stack.kv_heads, mode(), rowgemm.mode(),
                          stack.q_norms, stack.k_norms)


def fused_layer_rows(hidden: torch.Tensor, layer: FusedLayer, keys: torch.Tensor, values: torch.Tensor,
                     rows: list[int], starts: list[int], cos: torch.Tensor, sin: torch.Tensor,
                     mask: torch.Tensor | None) -> torch.Tensor:
    """:func:`fused_layer` for B sequences of T new tokens each (B, T, D) float32, sequence b on row ``rows[b]`` of a
    batched cache ``keys`` / ``values`` (R, KV, S, hd), its tokens written into slots ``starts[b] ..``; cos, sin
    (B, T, ..., hd/2); mask (B, T, S') bool (sequence b's first ``starts[b] + T`` columns are read) or None. Each
    token's arithmetic is that of a 1-token :func:`fused_layer` call: a sequence's result does not depend on the
    others in the batch, bit for bit."""
    return _ops().qlayer_rows(hidden, layer.weights, layer.kinds, layer.attn_norm, layer.mlp_norm, layer.eps, keys,
                              values, rows, starts, cos, sin, mask, layer.heads, layer.kv_heads, mode(),
                              rowgemm.mode(), layer.q_norm, layer.k_norm)


def fused_layer(hidden: torch.Tensor, layer: FusedLayer, keys: torch.Tensor, values: torch.Tensor, start: int,
                cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None, kv_only: bool = False) -> torch.Tensor:
    """One pre-norm Llama layer (Qwen3's where ``layer`` has q_norm and k_norm) for (1, T, D) float32 new tokens in
    one call, writing their keys and values into slots ``start ..`` of ``keys`` / ``values`` (1, KV, S, hd); cos,
    sin: (T, ..., hd/2); mask (T, start + T) bool or None (every slot visible). ``kv_only``: only write the keys and
    values, return ``hidden``. Row-invariant: a k-token call reproduces k 1-token calls bit for bit."""
    return _ops().qlayer(hidden, layer.weights, layer.kinds, layer.attn_norm, layer.mlp_norm, layer.eps, keys, values,
                         start, cos, sin, mask, layer.heads, layer.kv_heads, mode(), rowgemm.mode(), layer.q_norm,
                         layer.k_norm, kv_only)
