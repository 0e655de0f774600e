"""Pre-packed linear weights: each weight reordered once at load time for the kernel that multiplies it fastest.

A batch-1 decoder multiplies a few rows (1 for a plain step, 2-20 for a verify) by every weight matrix. torch's
eager ``F.linear`` hands such skinny products to MKL (fp32) or oneDNN (bf16) with the weight in its plain row-major
layout, and for 2-16 rows both can cost several times a 1-row product (bf16 on AVX2: k rows cost k times one).
Two packed paths, chosen per dtype from what this CPU and build can do (no setting):

- ``rows``: :mod:`specdraft.models.rowgemm`, a weight-stationary AVX2 kernel on a blocked copy. fp32 weights on
  any AVX2 CPU and bf16 weights where oneDNN has no bf16 kernel (AVX2-only CPUs). It is row-invariant: a k-token
  forward computes each token's products bit for bit as a 1-token forward does.
- ``onednn``: oneDNN's blocked layout (what inductor's freezing pass does, ``torch.ops.mkldnn._linear_pointwise``),
  for bf16 where oneDNN multiplies bf16 natively (AVX-512-BF16, AMX), and for fp32 where the kernel cannot be
  built. Where neither packs bf16, a bf16 weight gets an exact fp32 oneDNN copy for products of 6 rows or more.

``benchmarks/bench_verify_cost.py`` prints what each path costs per number of rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import specdraft.models.rowgemm as rowgemm

_ENV = "SPECDRAFT_PREPACK"  # "0" turns packing off, "rows" or "onednn" asks for that path (comparisons, exactness)
UPCAST_MIN_ROWS = 6  # without either kernel, a bf16 product of this many rows or more uses the fp32 oneDNN copy


@dataclass(frozen=True)
class PackedWeight:
    """A linear weight (N, K) prepared once: ``kind`` is ``rows`` (:mod:`rowgemm`'s blocked copy) or ``onednn``
    (oneDNN's layout, in the weight's dtype or as an exact fp32 copy of a bf16 weight)."""

    kind: str
    tensor: torch.Tensor
    out_features: int

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype


def enabled() -> bool:
    """Whether packing is on (default) and this torch build has oneDNN's linear ops."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (os.environ.get(_ENV, "1") != "0" and torch.backends.mkldnn.is_available()
            and hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise"))


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)  # (N, K) in oneDNN's blocked layout, batch hint 1


def _onednn(weight: torch.Tensor) -> PackedWeight | None:
    try:
        return PackedWeight("onednn", _reorder(weight), weight.shape[0])
    except RuntimeError:  # bf16 on a CPU without the instructions oneDNN's bf16 path needs (AVX2 machines)
        return None


def pack(weight: torch.Tensor, kind: str | None = None) -> PackedWeight | None:
    """``weight`` (N, K) prepared for :func:`linear` on this CPU, or None where nothing packs it (then
    ``F.linear``). ``kind`` None chooses as the module docstring says, or as ``SPECDRAFT_PREPACK`` asks; ``rows``
    or ``onednn`` asks for that path (e.g. ``rows`` for bf16 that is exact on AVX-512-BF16 CPUs too), None where it
    cannot pack this weight."""
    setting = os.environ.get(_ENV, "1")
    if setting == "0" or weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    kind = kind or (setting if setting in ("rows", "onednn") else None)
    with torch.no_grad():
        weight = weight.detach().contiguous()
        native = _onednn(weight) if enabled() and kind != "rows" else None
        if native is not None and (kind == "onednn" or weight.dtype == torch.bfloat16):
            return native
        if kind != "onednn" and rowgemm.available():
            return PackedWeight("rows", rowgemm.pack(weight), weight.shape[0])
        if kind == "rows" or not enabled():
            return None
        return native or _onednn(weight.float())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None
           ) -> torch.Tensor:
    """``x @ weight.T + bias`` for x (..., K): through the packed weight when given, else ``F.linear``."""
    if packed is None:
        return F.linear(x, weight, bias)
    if packed.kind == "rows":
        return rowgemm.linear(x, packed.tensor, bias, packed.out_features)  # (..., N)
    if packed.dtype == x.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, packed.tensor, bias, "none", [], "")  # (..., N)
    if x.numel() < UPCAST_MIN_ROWS * x.shape[-1]:  # few bf16 rows: bf16 reads half the bytes
        return F.linear(x, weight, bias)
    bias = None if bias is None else bias.float()
    return torch.ops.mkldnn._linear_pointwise(x.float(), packed.tensor, bias, "none", [], "").to(x.dtype)
