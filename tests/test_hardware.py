"""The machine's fast dtype: bf16 only where oneDNN multiplies bf16 natively (a bf16 CPU flag, and no
ONEDNN_MAX_CPU_ISA cap below its bf16 kernels, as the AVX2 emulation sets)."""

import os
import subprocess
import sys

import pytest
import torch

from specdraft import hardware


@pytest.mark.parametrize(("capability", "flags", "onednn", "native"), [
    ("AVX512", {"avx512f", "avx512_bf16"}, "", True),
    ("AVX512", {"avx512f", "amx_bf16"}, "", True),
    ("AVX512", {"avx512f"}, "", False),  # AVX-512 without bf16 instructions: emulated
    ("AVX2", {"avx2", "avx512_bf16"}, "", True),  # ATEN_CPU_CAPABILITY=avx2 alone: oneDNN still multiplies bf16
    ("AVX512", {"avx512_bf16"}, "AVX2", False),  # oneDNN capped below its bf16 kernels
    ("AVX512", {"avx512_bf16"}, "AVX512_CORE_AMX", True),
    ("DEFAULT", set(), "", False),
])
def test_cpu_bf16_needs_torchs_avx512_kernels_and_a_bf16_flag(monkeypatch, capability, flags, onednn, native):
    monkeypatch.setattr(hardware.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(hardware, "cpu_capability", lambda: capability)
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", onednn)
    ok, reason = hardware.cpu_bf16()
    assert ok is native and reason
    choice = hardware.resolve_dtype("auto", "cpu")
    assert choice.dtype == ("bfloat16" if native else "float32") and choice.reason.startswith("auto: ")


def test_explicit_values_are_kept_and_bad_ones_refused():
    assert hardware.resolve_dtype("float32").to_dict() == {"dtype": "float32", "reason": "set explicitly"}
    assert hardware.resolve_bf16(True).bf16 and not hardware.resolve_bf16(False).bf16
    assert hardware.resolve_bf16(None).reason.startswith("auto: ")
    with pytest.raises(ValueError, match="auto, float32 or bfloat16"):
        hardware.resolve_dtype("fp16")


def test_the_avx2_emulation_is_respected_in_a_fresh_process():
    code = "from specdraft import hardware; print(hardware.fast_dtype('cpu').dtype, hardware.cpu_capability())"
    env = os.environ | {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["float32", "AVX2"]


def test_auto_device_is_cuda_only_where_one_is_visible(monkeypatch):
    monkeypatch.setattr(hardware, "auto_is_cuda", lambda: False)  # the suite's own fixture does the same
    assert hardware.resolve_device("auto").to_dict() == {"device": "cpu", "reason": "auto: no CUDA device visible"}
    assert hardware.resolve_device("cpu").name == "cpu" and hardware.resolve_dtype("auto", "cpu").reason
    for bad in ("gpu", "cuda:x", "cuda:-1", ""):
        with pytest.raises(ValueError, match="auto, cpu, cuda or cuda:N"):
            hardware.resolve_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device is visible"):
            hardware.resolve_device("cuda:0")
    else:
        assert hardware.resolve_device("cuda").name.startswith("cuda:")
        with pytest.raises(ValueError, match="does not exist"):
            hardware.resolve_device(f"cuda:{torch.cuda.device_count()}")


def test_torchrun_processes_take_their_local_rank(monkeypatch):
    from specdraft.errors import SpecdraftError
    from specdraft.training.runs.trainer import init_distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SpecdraftError, match="cuda:LOCAL_RANK"):
        init_distributed("cuda:0")  # refused before any process group or device is touched
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_distributed("cpu") == (0, 1, torch.device("cpu"))
    with pytest.raises(SpecdraftError, match="device must be"):
        init_distributed("tpu")



_OPENMP_CHECK = """
import json, os, threading, time, torch
from specdraft.hardware import openmp_alone, release_openmp_workers

def count():
    return len(os.listdir("/proc/self/task"))

def settle(expected):  # workers exit a moment after being let go
    deadline = time.monotonic() + 5
    while count() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return count()

big = torch.randn(1 << 22)
torch.add(big, big)  # a parallel region: this thread's pool has its workers
workers, before = torch.get_num_threads() - 1, count()
seen = {"released": release_openmp_workers()}
seen["let go"] = before - settle(before - workers) == workers

def helper():
    seen["alone"] = openmp_alone()
    start = count()
    torch.add(big, big)
    seen["helper threads"], seen["made"] = torch.get_num_threads(), count() - start

thread = threading.Thread(target=helper)
thread.start()
thread.join()
seen["caller threads"] = torch.get_num_threads()
print(json.dumps(seen))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not os.path.exists("/proc/self/task"), reason="needs 2 cores")
def test_openmp_workers_are_let_go_and_a_helper_thread_keeps_none():
    """The decoding thread's parallel regions stay fast only while no other thread keeps OpenMP workers: a thread
    lets its own go (release_openmp_workers), and a helper thread's later parallel work makes none (openmp_alone).
    In a fresh interpreter, whose threads nothing else starts or ends."""
    import json

    threads = 2
    out = subprocess.run([sys.executable, "-c", _OPENMP_CHECK], capture_output=True, text=True, timeout=120,
                         env=os.environ | {"OMP_NUM_THREADS": str(threads)}, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"released": True, "let go": True, "alone": True, "helper threads": 1, "made": 0,
                    "caller threads": threads}
