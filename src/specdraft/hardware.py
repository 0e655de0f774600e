"""What this machine computes fast: whether bf16 is native here, decided from the kernels torch will actually run.

bf16 pays only where the hardware multiplies bf16 natively: CUDA devices that support it, and x86 CPUs with
AVX-512-BF16 or AMX-BF16 (oneDNN's bf16 matrix products), or aarch64 CPUs with the BF16 extension. Elsewhere it is
emulated by converting to fp32, and a bf16 run is several times slower than fp32 (17x for pretraining on an
AVX2-only CPU). The decision follows the kernels that do the matrix products, oneDNN's: ``ONEDNN_MAX_CPU_ISA``
below AVX512_CORE_BF16 turns native bf16 off (as on an AVX2-only machine). torch's own kernel level
(``ATEN_CPU_CAPABILITY``, :func:`cpu_capability`) is reported but does not decide: measured on an AVX-512-BF16 CPU
under ``ATEN_CPU_CAPABILITY=avx2`` alone, bf16 training steps were still 1.3-1.9x faster than fp32, because the
products still ran in oneDNN; with ``ONEDNN_MAX_CPU_ISA=AVX2`` as well they were 2-2.4x slower
(``benchmarks/dtype_training.py``).

Where a stage runs is decided here too: ``--device auto`` is the CUDA device when one is visible (under torchrun
the process's ``LOCAL_RANK``), else the CPU (:func:`resolve_device`).

Nothing here imports the rest of specdraft; :func:`fast_dtype`, :func:`resolve_dtype` and :func:`resolve_device` are
the entry points.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

import torch

AUTO = "auto"
DTYPE_NAMES = ("float32", "bfloat16")
_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 flags in /proc/cpuinfo
_ARM_BF16_FLAG = "bf16"  # aarch64 "Features"
_ONEDNN_BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10", "ALL")


@dataclass(frozen=True)
class DtypeChoice:
    """A dtype name (``float32`` or ``bfloat16``) and why it was chosen, for a run's config and logs."""

    dtype: str
    reason: str

    @property
    def bf16(self) -> bool:
        return self.dtype == "bfloat16"

    def to_dict(self) -> dict[str, str]:
        return {"dtype": self.dtype, "reason": self.reason}


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def cpu_identity() -> str:
    """The CPU's model name with its family, model and stepping (``AMD EPYC`` names several generations), e.g.
    ``AMD EPYC (family 25 model 1 stepping 1)``."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not key.strip():
                    break  # the first processor's block ends
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    numbers = [f"{name} {fields[key]}" for key, name in (("cpu family", "family"), ("model", "model"),
                                                         ("stepping", "stepping")) if key in fields]
    return f"{cpu_model()} ({' '.join(numbers)})" if numbers else cpu_model()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where that file does not exist)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as file:
            for line in file:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def cpu_capability() -> str:
    """The SIMD level of torch's CPU kernels (``AVX512``, ``AVX2``, ``DEFAULT``, ...): respects
    ``ATEN_CPU_CAPABILITY``."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "DEFAULT"


def cpu_bf16() -> tuple[bool, str]:
    """(whether bf16 matrix products are native on this CPU, the reason in words)."""
    capability, flags = cpu_capability(), cpu_flags()
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        native = _ARM_BF16_FLAG in flags
        return native, f"aarch64 CPU {'with' if native else 'without'} the BF16 extension"
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if onednn and not onednn.startswith(_ONEDNN_BF16_ISAS):
        return False, f"ONEDNN_MAX_CPU_ISA={onednn} keeps oneDNN below its bf16 kernels"
    found = [flag for flag in _BF16_CPU_FLAGS if flag in flags]
    if not found:
        return False, f"CPU without avx512_bf16 / amx_bf16 (torch kernels {capability}): bf16 is emulated"
    return True, f"CPU with {', '.join(found)} (torch kernels {capability}): oneDNN multiplies bf16 natively"


def fast_dtype(device: str | torch.device = "cpu") -> DtypeChoice:
    """The faster of bfloat16 and float32 for training and batched generation on ``device``."""
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return DtypeChoice("bfloat16", f"CUDA device {torch.cuda.get_device_name(device)} supports bf16")
        return DtypeChoice("float32", "CUDA device without bf16 support")
    native, why = cpu_bf16()
    return DtypeChoice("bfloat16" if native else "float32", why)


def auto_is_cuda() -> bool:
    """Whether ``--device auto`` means CUDA: a CUDA device is visible."""
    return torch.cuda.is_available()


def default_device() -> torch.device:
    """Where ``auto`` runs: this process's CUDA device when one is visible (``LOCAL_RANK`` under torchrun), else the
    CPU."""
    return resolve_device(AUTO).device


@dataclass(frozen=True)
class DeviceChoice:
    """A device (``cpu``, ``cuda:N``) and why it was chosen, for a run's config and logs."""

    name: str
    reason: str

    @property
    def device(self) -> torch.device:
        return torch.device(self.name)

    def to_dict(self) -> dict[str, str]:
        return {"device": self.name, "reason": self.reason}


def check_device_name(name: str) -> None:
    """Raise ``ValueError`` unless ``name`` is ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (whether that device exists
    is checked when it is used, by :func:`resolve_device`)."""
    kind, _, index = str(name).partition(":")
    if name in (AUTO, "cpu", "cuda") or (kind == "cuda" and index.isdigit()):
        return
    raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")


def resolve_device(name: str = AUTO) -> DeviceChoice:
    """``name`` as a :class:`DeviceChoice`: ``auto`` is CUDA when visible, else the CPU; ``cuda`` is this process's
    CUDA device (``LOCAL_RANK`` under torchrun, else the current one). Raises ``ValueError`` for a bad name or a CUDA
    device that is not there."""
    check_device_name(name)
    if name == "cpu" or (name == AUTO and not auto_is_cuda()):
        return DeviceChoice("cpu", "set explicitly" if name == "cpu" else "auto: no CUDA device visible")
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: no CUDA device is visible (torch.cuda.is_available() is False)")
    count = torch.cuda.device_count()
    if ":" in name:
        index = int(name.partition(":")[2])
    else:
        index = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
    if index >= count:
        raise ValueError(f"device {name!r}: cuda:{index} does not exist ({count} CUDA device(s) visible)")
    what = f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return DeviceChoice(f"cuda:{index}", f"auto: {what}" if name == AUTO else f"set explicitly: {what}")


def resolve_dtype(name: str, device: str | torch.device | None = None) -> DtypeChoice:
    """``name`` as a :class:`DtypeChoice`: ``auto`` becomes :func:`fast_dtype` of ``device`` (default: CUDA when
    available, else the CPU); an explicit name is kept. Raises ``ValueError`` for another name."""
    if name == AUTO:
        choice = fast_dtype(default_device() if device is None else device)
        return DtypeChoice(choice.dtype, f"auto: {choice.reason}")
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be auto, float32 or bfloat16, got {name!r}")
    return DtypeChoice(name, "set explicitly")


def resolve_bf16(value: bool | None, device: str | torch.device | None = None) -> DtypeChoice:
    """bf16 autocast on or off: ``None`` means auto (:func:`fast_dtype`), a bool is kept."""
    if value is None:
        return resolve_dtype(AUTO, device)
    return DtypeChoice("bfloat16" if value else "float32", "set explicitly")


@functools.cache
def _openmp_runtime():
    """The GNU OpenMP runtime torch has loaded (ctypes), or None (another runtime, or none): looked up once, as torch
    loads it with itself."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and line.rstrip().endswith(".so.1")}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            runtime = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)
            runtime.omp_pause_resource_all.argtypes = runtime.omp_set_num_threads.argtypes = [ctypes.c_int]
            runtime.omp_pause_resource_all.restype = ctypes.c_int
        except (OSError, AttributeError):
            continue
        return runtime
    return None


def release_openmp_workers() -> bool:
    """Let the calling thread's OpenMP worker threads go (``omp_pause_resource_all(omp_pause_soft)``, OpenMP 5.0), in
    the GNU OpenMP runtime torch has loaded; True where it did. For a thread that has run parallel work (loading a
    model) and hands the kernels over to another thread (the server's decoding thread): each thread that runs a
    parallel region keeps a pool of its own, and when the pools' threads outnumber the cores, libgomp's idle workers
    stop spinning and sleep at once, so every parallel region then waits for a sleeping worker to wake. On a 2-core
    AMD EPYC that made a 576 x 3072 block product 162 µs instead of 42 µs, and decoding in the server's thread 3x
    slower than in the thread that loaded the model. A later parallel region in the calling thread makes its pool
    again."""
    runtime = _openmp_runtime()
    return runtime is not None and runtime.omp_pause_resource_all(1) == 0  # omp_pause_soft


def openmp_alone() -> bool:
    """Run the calling thread's parallel regions on it alone from now on (its OpenMP threads 1, after torch's own
    per-thread setting) and let its workers go: for a helper thread beside the one that decodes (the server's
    tokenizer), whose small tensor work would otherwise keep a pool of workers that slows every parallel region of
    the decoding thread (:func:`release_openmp_workers`). True where it could."""
    torch.get_num_threads()  # torch sets a thread's OpenMP threads on its first use there; it must not undo this
    runtime = _openmp_runtime()
    if runtime is None:
        return False
    runtime.omp_set_num_threads(1)
    return release_openmp_workers()
