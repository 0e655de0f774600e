"""Pre-packed linear weights: each weight reordered once at load time for the kernel that multiplies it fastest.

A batch-1 decoder multiplies a few rows (1 for a plain step, 2-20 for a verify) by every weight matrix. torch's
eager ``F.linear`` hands such skinny products to MKL (fp32) or oneDNN (bf16) with the weight in its plain row-major
layout, and for 2-16 rows both can cost several times a 1-row product (bf16 on AVX2: k rows cost k times one).
Two packed paths, chosen from what this CPU and build can do (no setting):

- ``rows`` (wherever :mod:`specdraft.models.rowgemm` builds: x86 with AVX2 and a C++ compiler): a
  weight-stationary kernel on a blocked copy, 256-bit, 512-bit or AVX-512-BF16 as the CPU allows. It is
  row-invariant: a forward of up to :data:`ROWS_MAX` tokens computes each token's products bit for bit as a 1-token
  forward does. Larger products (a long prompt's prefill) go to ``F.linear`` where oneDNN multiplies bf16 natively.
- ``onednn``: oneDNN's blocked layout (what inductor's freezing pass does, ``torch.ops.mkldnn._linear_pointwise``),
  where the kernel cannot be built. A bf16 weight oneDNN cannot pack (AVX2-only CPUs) gets an exact fp32 copy
  there, for products of 6 rows or more.

``benchmarks/bench_verify_cost.py`` prints what each path costs per number of rows.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import specdraft.models.rowgemm as rowgemm
from specdraft.models.hugepages import with_huge_page_copies

_ENV = "SPECDRAFT_PREPACK"  # "0" turns packing off, "rows" or "onednn" asks for that path (comparisons, exactness)
UPCAST_MIN_ROWS = 6  # without either kernel, a bf16 product of this many rows or more uses the fp32 oneDNN copy
ROWS_MAX = 64  # the rows path is row-invariant up to this many rows (decode steps, verifies); more is a prefill


@dataclass(frozen=True)
class PackedWeight:
    """A linear weight (N, K) prepared once: ``kind`` is ``rows`` (:mod:`rowgemm`'s blocked copy) or ``onednn``
    (oneDNN's layout, in the weight's dtype or as an exact fp32 copy of a bf16 weight)."""

    kind: str
    tensor: torch.Tensor
    out_features: int
    plain_for_many: bool = False  # rows: products of more than ROWS_MAX rows are cheaper through F.linear

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
    or ``onednn`` asks for that path (for comparisons), None where it cannot pack this weight."""
    setting = os.environ.get(_ENV, "1")
    if setting == "0" or weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    kind = kind or (setting if setting in ("rows", "onednn") else None)
    with torch.no_grad():
        weight = weight.detach().contiguous()
        if kind != "onednn" and rowgemm.available():
            many = weight.dtype == torch.bfloat16 and _onednn_bf16()  # oneDNN's own bf16 GEMM beats rows at 64+
            return PackedWeight("rows", rowgemm.pack(weight), weight.shape[0], plain_for_many=many)
        if kind == "rows" or not enabled():
            return None
        return _onednn(weight) or _onednn(weight.float())


def in_huge_pages(weights: Sequence[PackedWeight | None]) -> list[PackedWeight | None]:
    """``weights`` with the row kernel's packed copies moved into transparent huge pages
    (:mod:`specdraft.models.hugepages`: a step streams them all); oneDNN's opaque tensors and None stay."""
    rows = [weight for weight in weights if weight is not None and weight.kind == "rows"]
    moved = dict(zip(map(id, rows), with_huge_page_copies(rows, "tensor"), strict=True))
    return [moved.get(id(weight), weight) for weight in weights]


@functools.cache
def _onednn_bf16() -> bool:
    """Whether oneDNN packs (so multiplies natively) bf16 on this CPU."""
    return enabled() and _onednn(torch.zeros(16, 16, dtype=torch.bfloat16)) is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None
           ) -> torch.Tensor:
    """``x @ weight.T + bias`` for x (..., K): through the packed weight when given, else ``F.linear``."""
    if packed is None:
        return F.linear(x, weight, bias)
    if packed.kind == "rows":
        if packed.plain_for_many and x.numel() > ROWS_MAX * x.shape[-1]:
            return F.linear(x, weight, bias)
        return rowgemm.linear(x, packed.tensor, bias, packed.out_features)  # (..., N)
    if packed.dtype == x.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, packed.tensor, bias, "none", [], "")  # (..., N)
    if x.numel() < UPCAST_MIN_ROWS * x.shape[-1]:  # few bf16 rows: bf16 reads half the bytes
        return F.linear(x, weight, bias)
    bias = None if bias is None else bias.float()
    return torch.ops.mkldnn._linear_pointwise(x.float(), packed.tensor, bias, "none", [], "").to(x.dtype)
