"""Row-invariant kernels for batch-1 decoding (``rowgemm.cpp``, ``rowattention.cpp``), built once per machine.

A batch-1 verify multiplies k = 2-20 rows by every weight. Where oneDNN cannot multiply bf16 natively (CPUs
without AVX-512 BW/VL/DQ, e.g. AVX2-only ones) torch's eager bf16 ``F.linear`` costs about k times a 1-row product,
so a 5-token verify cost 3.6 plain steps. :func:`linear` streams the weights once, in panels of 16 output columns
prefetched ahead, widens bf16 to fp32 in registers (exact) and multiplies each weight row into all k rows with
256-bit FMAs: k rows cost one pass over the weights plus k times the arithmetic (with two threads, a 5-row product
over SmolLM2's weights costs about 1.2 one-row products on AVX2 and AVX-512 CPUs alike).
:func:`attention` attends each new query with the arithmetic of a query alone, widening each block of cached keys
and values to fp32 once for all the queries of its KV head. Each output element is computed by the same instruction
sequence whatever the number of rows, so a k-token forward reproduces k 1-token forwards bit for bit.

The kernels are compiled with ``torch.utils.cpp_extension`` (a C++ compiler and ninja) on first use, about 10 s,
into ``<specdraft cache>/kernels/`` keyed by the sources, flags and torch version, and loaded from there afterwards.
Without a compiler, on a CPU without AVX2 and FMA, or with ``SPECDRAFT_ROWGEMM=0``, :func:`available` is False and
callers keep their other paths.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import platform
import sys
import warnings
from pathlib import Path

import torch

from specdraft.files import cache_dir
from specdraft.hardware import cpu_capability, cpu_flags

_ENV = "SPECDRAFT_ROWGEMM"  # "0" turns the kernel off (for comparisons)
_WIDTH_ENV = "SPECDRAFT_ROWGEMM_WIDTH"  # "256" keeps the 256-bit attention on AVX-512 CPUs (for comparisons)
_SOURCES = tuple(Path(__file__).with_name(name)
                 for name in ("rowgemm.cpp", "rowattention.cpp", "quantgemm.cpp", "quantlayer.cpp"))
_HEADERS = tuple(Path(__file__).with_name(name) for name in ("rowkernels.h", "rowattention_fixed.h", "quantkernels.h"))
# explicit FMAs only (the summation order is the source's); OpenMP so that at::parallel_for splits the work (without
# it the pragma inside ATen's header is ignored and every product runs on one thread)
_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp")


def _build_folder() -> Path:
    texts = [path.read_text() for path in (*_SOURCES, *_HEADERS)]
    # torch's headers by their path as this interpreter sees it: the build file names it, so two environments that
    # share the cache (or one reached through two paths) would otherwise rebuild each other's kernels on every load
    key = "|".join((*texts, " ".join(_FLAGS), torch.__version__, sys.version, str(Path(torch.__file__).parent)))
    return cache_dir() / "kernels" / f"rowgemm-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _put_ninja_on_path() -> None:
    """torch's extension builder runs ``ninja`` from PATH; the ``ninja`` wheel installs it beside this interpreter,
    which is not on PATH when the environment is used without activating it (``.venv/bin/python -m ...``)."""
    folder = str(Path(sys.executable).parent)
    if (Path(folder) / "ninja").exists() and folder not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([folder, os.environ.get("PATH", "")])


def build_id() -> str:
    """Names this build of the kernels (their sources, flags, torch and Python): costs measured with another differ."""
    return _build_folder().name


@contextlib.contextmanager
def _build_lock(folder: Path):
    """One process at a time builds or loads the kernels in ``folder``: an ``flock`` that the system releases when its
    holder dies. torch's own build lock is a plain file that a killed build leaves behind, and a process that finds
    it waits for its removal forever; under the ``flock`` no other build runs, so such a file is stale: removed."""
    with open(folder / "build.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (folder / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.cache
def _load() -> bool:
    """Build (first time on this machine) and load the kernel; False, with one warning, where that fails."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not {"avx2", "fma", "f16c"} <= cpu_flags():
        return False
    try:
        from torch.utils import cpp_extension

        _put_ninja_on_path()
        folder = _build_folder()
        folder.mkdir(parents=True, exist_ok=True)
        with _build_lock(folder):
            cpp_extension.load(name="specdraft_rowgemm", sources=[str(path) for path in _SOURCES],
                               extra_cflags=list(_FLAGS), build_directory=str(folder), is_python_module=False,
                               verbose=False)
        return hasattr(torch.ops.specdraft_rowgemm, "linear")
    except Exception as exc:  # no compiler, no ninja, a read-only cache: the other paths remain
        warnings.warn(f"specdraft: the row-product kernel could not be built ({str(exc).splitlines()[0][:200]}); "
                      "multi-token bf16 forwards use torch's kernels", stacklevel=2)
        return False


@functools.cache
def mode() -> int:
    """Which variant :func:`attention` runs, fixed per process: 0 the 256-bit kernel; 1 the 512-bit one where torch's
    kernels dispatch to AVX-512 (``ATEN_CPU_CAPABILITY=avx2`` keeps 0) and the CPU has AVX-512 F/BW/DQ/VL.
    ``SPECDRAFT_ROWGEMM_WIDTH=256`` keeps 0, for comparisons. :func:`linear` runs one 256-bit kernel everywhere."""
    flags, limit = cpu_flags(), os.environ.get(_WIDTH_ENV, "")
    if limit == "256" or not cpu_capability().startswith("AVX512"):
        return 0
    return 1 if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags else 0


def available() -> bool:
    """Whether the kernel can run here (building it on first call); False with ``SPECDRAFT_ROWGEMM=0``."""
    return os.environ.get(_ENV, "1") != "0" and _load()


def loaded() -> bool:
    """Whether the kernels are loaded in this process already (never builds them)."""
    return _load.cache_info().currsize > 0 and _load()


def argmax_finite(logits: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Each row's first largest entry of ``logits`` (R, V) float32, (R,) long (``torch.argmax``'s choice), and whether
    every entry is finite, in one pass over the rows. Requires :func:`available`."""
    return torch.ops.specdraft_rowgemm.argmax_finite(logits)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (N, K) in fp32 or bf16 laid out for :func:`linear`: panels of 16 output columns, (ceil(N / 16), K,
    16), zero-padded. Requires :func:`available`."""
    _load()
    return torch.ops.specdraft_rowgemm.pack(weight.detach())


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """``x @ weight.T + bias`` for x (..., K) in fp32 or bf16, ``packed`` = :func:`pack` (weight) with ``n`` rows:
    accumulated in fp32 (one FMA chain over k per element), rounded once to x's dtype. Returns (..., n)."""
    return torch.ops.specdraft_rowgemm.linear(x, packed, bias, n)


def attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
              ) -> torch.Tensor:
    """Grouped-query softmax attention, each query on its own (row-invariant, scale 1/sqrt(hd)).

    Args:
        queries: (B, T, H, hd), rotated; hd a multiple of 8.
        keys, values: (B, K, S, hd) in fp32 or bf16, the cache including the new positions (strided views work).
        mask: (T, S) bool, True where a query sees a slot; None: every query sees every slot.

    Returns:
        (B, T, H*hd) in the queries' dtype.
    """
    _load()
    return torch.ops.specdraft_rowgemm.attention(queries, keys, values, mask, queries.shape[-1] ** -0.5, mode())
