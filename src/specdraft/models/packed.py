"""Pre-packed linear weights: oneDNN's blocked weight layout, reordered once at load time.

A batch-1 decoder multiplies a few rows (1 for a plain step, 2-17 for a verify) by every weight matrix. torch's
eager ``F.linear`` hands such skinny products to MKL (fp32) or oneDNN (bf16) with the weight in its plain row-major
layout, and for 2-16 rows both can cost several times a 1-row product. oneDNN's ``linear`` on a weight reordered
once into its preferred blocked layout (what inductor's freezing pass does, ``torch.ops.mkldnn._linear_pointwise``)
keeps a 5-row product within about 1.5x of a 1-row one on both AVX2 and AVX-512 (``benchmarks/bench_verify_cost.py``).

Where oneDNN cannot pack bf16 on this CPU (without AVX-512BW/VL/DQ or AVX-NE-CONVERT, e.g. AVX2-only machines),
a bf16 model keeps ``F.linear`` for products of up to 5 rows and multiplies more rows in fp32 on a packed fp32
copy.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

_ENV = "SPECDRAFT_PREPACK"  # "0" turns packing off (for comparisons)
UPCAST_MIN_ROWS = 6  # a bf16 product of this many rows or more uses the fp32 copy (AVX2: 5 rows cost the same
#                      either way, 9 rows 1.4x and 17 rows 2.1x less through the fp32 copy)


def enabled() -> bool:
    """Whether packing is on (default) and this torch build has oneDNN's linear ops."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (os.environ.get(_ENV, "1") != "0" and torch.backends.mkldnn.is_available()
            and hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise"))


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)  # (N, K) in oneDNN's blocked layout, batch hint 1


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` (N, K) reordered into oneDNN's layout for a CPU linear, or None where that is unavailable.

    A bf16 weight that oneDNN cannot pack on this CPU is packed as its exact fp32 upcast instead (twice the bytes):
    :func:`linear` then multiplies up to 5 rows in bf16 (``F.linear`` streams half the bytes) and more rows in
    fp32, the better dtype per shape.
    """
    if not enabled() or weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    with torch.no_grad():
        weight = weight.detach().contiguous()
        try:
            return _reorder(weight)
        except RuntimeError:  # bf16 on a CPU without the instructions oneDNN's bf16 path needs (AVX2 machines)
            if weight.dtype != torch.bfloat16:
                return None
        try:
            return _reorder(weight.float())
        except RuntimeError:
            return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
           ) -> torch.Tensor:
    """``x @ weight.T + bias`` for x (..., K): through the packed weight when given, else ``F.linear``."""
    if packed is None:
        return F.linear(x, weight, bias)
    if packed.dtype == x.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # (..., N)
    if x.numel() < UPCAST_MIN_ROWS * x.shape[-1]:  # few bf16 rows: bf16 reads half the bytes
        return F.linear(x, weight, bias)
    bias = None if bias is None else bias.float()
    return torch.ops.mkldnn._linear_pointwise(x.float(), packed, bias, "none", [], "").to(x.dtype)  # (..., N)
