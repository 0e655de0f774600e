"""Which llama.cpp build runs on this machine: the AMX decision of ``make engines`` and the check ``bench`` makes.

llama.cpp's CPU backend is compiled with ``-march=native`` (``GGML_NATIVE``, the default of ``make engines``); on
GCC and Clang that flag alone decides the instruction sets, and ggml's ``GGML_AMX_TILE`` / ``GGML_AMX_INT8`` /
``GGML_AMX_BF16`` options are read only when ``GGML_NATIVE`` is off. Where the CPU reports AMX, ``-march=native``
defines ``__AMX_INT8__`` and ggml adds its AMX weight buffer, which packs Q4_0/Q4_1/Q8_0/K-quant weights at load
and multiplies batches of two or more rows with tile instructions (one row takes its AVX-512-VNNI kernel). A Linux
process may run tile instructions only after asking the kernel (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``), and a virtual machine may report AMX yet not let a process use it: ggml checks only the
request, so the first batch (``llama-server``'s warm-up at load, any prompt in ``llama-bench``) dies with SIGILL.

So the build asks first: a tiny C program (:data:`PROBE_SOURCE`) requests the permission and multiplies one tile
product in two threads, in a child process, so a SIGILL only ends the child. AMX stays on only when that product is
right; otherwise the build adds ``-mno-amx-tile -mno-amx-int8 -mno-amx-bf16`` (explicit ``-m`` flags override
``-march=native`` whatever their order) and checks that the compiler no longer defines any ``__AMX`` macro. Every
other native instruction set, and ggml's weight repacking for the non-AMX paths, stay on.

``make engines`` writes :data:`BUILD_INFO` beside the programs: the llama.cpp version, the build options, the AMX
decision and this machine's CPU model and flags. :func:`check_build` (run by ``bench`` before starting a
``llama-server``) refuses a build made for another CPU, or before this file existed, with one line that says to
rerun ``make engines``.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from specdraft.errors import SpecdraftError
from specdraft.hardware import cpu_flags, cpu_model

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
BUILD_INFO = "specdraft-build.json"
PROBE = "amx-probe"  # the probe's binary, kept beside the programs so bench can ask again
FORMAT = 1
NO_AMX_FLAGS = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
USABLE = "usable"

PROBE_SOURCE = r"""
/* Exit 0 when this process may run AMX tile instructions: request XTILEDATA, then one int8 tile product
   (16x64 ones times 64x16 twos: every sum is 128) in the main thread and in a second thread. */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

struct tile_config { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

static void *tile_product(void *unused) {
    struct tile_config cfg;
    int8_t a[16 * 64], b[16 * 64];
    int32_t c[16 * 16];
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 3; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    memset(a, 1, sizeof a);
    memset(b, 2, sizeof b);
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_loadd(1, a, 64);
    _tile_loadd(2, b, 64);
    _tile_dpbssd(0, 1, 2);
    _tile_stored(0, c, 64);
    _tile_release();
    for (int i = 0; i < 16 * 16; i++) if (c[i] != 128) return (void *) 1;
    return NULL;
    (void) unused;
}

int main(int argc, char **argv) {
    void *bad = NULL;
    pthread_t thread;
    if (!(argc > 1 && strcmp(argv[1], "--no-request") == 0)
        && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 3;
    if (tile_product(NULL)) return 4;
    if (pthread_create(&thread, NULL, tile_product, NULL) != 0 || pthread_join(thread, &bad) != 0) return 5;
    return bad ? 4 : 0;
}
"""
_PROBE_EXITS = {3: "the kernel refused the AMX permission (arch_prctl)", 4: "a tile product came out wrong",
                5: "the probe could not start a thread"}


def compiler() -> str:
    """The C compiler cmake will use: ``$CC``, else ``cc``."""
    return os.environ.get("CC") or "cc"


def native_amx_macros(cc: str, extra_flags: tuple[str, ...] = ()) -> list[str]:
    """The ``__AMX*`` macros ``cc -march=native`` (plus ``extra_flags``) defines on this machine."""
    done = subprocess.run([cc, "-march=native", *extra_flags, "-dM", "-E", "-x", "c", os.devnull],
                          capture_output=True, text=True, check=True)
    return sorted(line.split()[1] for line in done.stdout.splitlines() if line.startswith("#define __AMX"))


def compile_probe(cc: str, dest: Path) -> str | None:
    """Compile :data:`PROBE_SOURCE` to ``dest``; the compiler's complaint when it cannot (None when it did)."""
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "amx_probe.c"
        source.write_text(PROBE_SOURCE)
        done = subprocess.run([cc, "-O1", "-mamx-tile", "-mamx-int8", str(source), "-o", str(dest), "-pthread"],
                              capture_output=True, text=True)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["failed"])[-1]


def run_probe(probe: Path, request: bool = True) -> str:
    """:data:`USABLE`, or why this process may not run tile instructions (the probe runs as a child process)."""
    try:
        done = subprocess.run([str(probe), *([] if request else ["--no-request"])], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the probe did not run ({exc})"
    if done.returncode == 0:
        return USABLE
    if done.returncode == -4:
        return "SIGILL: the CPU reports AMX but this process may not run tile instructions"
    return _PROBE_EXITS.get(done.returncode, f"the probe exited with {done.returncode}")


def decide_amx(cc: str, probe_dest: Path) -> dict:
    """The AMX decision for this machine: ``{"native": macros -march=native defines, "probe": USABLE or why not,
    "enabled": bool, "c_flags": flags added to the build, "compiled": macros left with those flags}``."""
    native = native_amx_macros(cc)
    if not native:
        return {"native": [], "probe": "not run: -march=native has no AMX here", "enabled": False, "c_flags": [],
                "compiled": []}
    problem = compile_probe(cc, probe_dest)
    probe = run_probe(probe_dest) if problem is None else f"the probe did not compile ({problem})"
    enabled = probe == USABLE
    flags = [] if enabled else list(NO_AMX_FLAGS)
    compiled = native_amx_macros(cc, tuple(flags))
    if not enabled and compiled:
        raise SpecdraftError(f"{cc} still defines {', '.join(compiled)} with {' '.join(flags)}")
    return {"native": native, "probe": probe, "enabled": enabled, "c_flags": flags, "compiled": compiled}


def machine() -> dict:
    """This machine's CPU as a build records it: model name and flags."""
    return {"cpu": cpu_model(), "flags": sorted(cpu_flags())}


def read_build_info(bin_dir: Path) -> dict | None:
    """The build info beside the programs in ``bin_dir`` (None when there is none or it is unreadable)."""
    try:
        info = json.loads((Path(bin_dir) / BUILD_INFO).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return info if isinstance(info, dict) else None


def write_build_info(bin_dir: Path, info: dict) -> Path:
    """Write ``info`` as the build info of ``bin_dir`` (beside, then renamed into place)."""
    path = Path(bin_dir) / BUILD_INFO
    tmp = path.with_name(f".{BUILD_INFO}.{os.getpid()}")
    tmp.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def build_problem(info: dict | None, here: dict | None = None) -> str | None:
    """Why the build described by ``info`` does not fit this machine (None when it does)."""
    if info is None:
        return "it has no build info (made before specdraft recorded one)"
    if info.get("format") != FORMAT or info.get("llama_cpp_python") != LLAMA_CPP_PYTHON_VERSION:
        return (f"it is llama-cpp-python {info.get('llama_cpp_python')} (build info format {info.get('format')}), "
                f"this specdraft uses {LLAMA_CPP_PYTHON_VERSION} (format {FORMAT})")
    here = here or machine()
    built = info.get("machine") or {}
    if built.get("cpu") != here["cpu"]:
        return f"it was built on a {built.get('cpu')!r} CPU, this one is a {here['cpu']!r}"
    gained, lost = sorted(set(here["flags"]) - set(built.get("flags", ()))), \
        sorted(set(built.get("flags", ())) - set(here["flags"]))
    if gained or lost:
        shown = [f"+{f}" for f in gained[:6]] + [f"-{f}" for f in lost[:6]]
        return f"this CPU's flags differ from the build's ({' '.join(shown)})"
    return None


def check_build(bin_dir: Path) -> dict | None:
    """The build info of the llama.cpp programs in ``bin_dir``, checked against this machine; None for programs
    that carry none and are not ``make engines``'s (``$SPECDRAFT_LLAMA_CPP_BIN``, PATH: the user's own build).

    A ``make engines`` build (or any folder holding :data:`BUILD_INFO`) made for another CPU, before build infos,
    or with AMX on where this process may no longer run tile instructions is a :class:`SpecdraftError` that says
    to rerun ``make engines``.
    """
    info = read_build_info(bin_dir)
    if info is None and not (Path(bin_dir) / BUILD_INFO).exists() and not is_engines_build(bin_dir):
        return None
    problem = build_problem(info)
    if problem is None and (info.get("amx") or {}).get("enabled"):
        probe = run_probe(Path(bin_dir) / PROBE)
        problem = None if probe == USABLE else f"it uses AMX and {probe}"
    if problem:
        raise SpecdraftError(f"the llama.cpp build in {bin_dir} does not fit this machine: {problem}; "
                             "rerun `make engines`")
    return info


def engines_bin_dir() -> Path:
    """Where ``make engines`` puts the llama.cpp programs."""
    from specdraft.models.registry import cache_dir

    source = cache_dir() / "engines" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
    return source / "build" / "bin"


def is_engines_build(bin_dir: Path) -> bool:
    """Whether ``bin_dir`` is ``make engines``'s folder of programs."""
    return Path(bin_dir).resolve() == engines_bin_dir().resolve()


def build_summary(info: dict | None) -> dict:
    """What a benchmark row records of its llama.cpp build: version, commit, the options and flags that chose the
    kernels, AMX on or off (and why), weight repacking (on: ``llama-server``'s default, which bench keeps), and
    whether the build was checked against this machine."""
    repack = True
    if info is None:
        return {"checked": False, "repack": repack, "note": "a llama.cpp build without specdraft build info"}
    amx = info.get("amx") or {}
    return {"checked": True, "llama_cpp_python": info.get("llama_cpp_python"), "commit": info.get("commit"),
            "cmake_options": info.get("cmake_options"), "c_flags": amx.get("c_flags"),
            "amx": bool(amx.get("enabled")), "amx_probe": amx.get("probe"), "repack": repack,
            "cpu": (info.get("machine") or {}).get("cpu")}
