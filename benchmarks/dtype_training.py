"""bf16 autocast against fp32 for a short `specdraft finetune` on the real target, on this CPU's native paths and on
its AVX2 paths (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2``), interleaved, with
what ``--bf16`` auto would choose under each. Each run is a fresh process; the rate is response tokens per second
between the first and the last logged step (the first step's warm-up left out).

    .venv/bin/python benchmarks/dtype_training.py --data DISTILL_DATA_FOLDER [--steps 6] [--rounds 2] [--batch-size 4]
        [--max-seq-len 256]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def run(args: argparse.Namespace, bf16: bool, env: dict, out: Path) -> float:
    """Response tokens/s of one short finetune run (steps 2..last)."""
    data, steps = args.data, args.steps
    cmd = [sys.executable, "-m", "specdraft.cli", "finetune", "--drafter", "smollm2-135m-instruct-drafter",
           "--target", "smollm2-135m-instruct", "--data", data, "--out", str(out), "--steps", str(steps),
           "--batch-size", str(args.batch_size), "--max-seq-len", str(args.max_seq_len), "--log-every", "1",
           "--eval-prompts", "0", "--heldout-every", "50", "--allow-incomplete", "--freeze-embeddings",
           "--no-progress",
           "--bf16" if bf16 else "--no-bf16", "--stop-after", str(steps)]
    subprocess.run(cmd, check=True, env=os.environ | env, capture_output=True)
    rows = list(csv.DictReader(open(out / "train_log.csv")))
    first, last = rows[0], rows[-1]
    return (int(last["tokens"]) - int(first["tokens"])) / (float(last["wall_s"]) - float(first["wall_s"]))


def auto_choice(env: dict) -> str:
    code = "from specdraft.hardware import fast_dtype; c = fast_dtype('cpu'); print(c.dtype, '|', c.reason)"
    return subprocess.run([sys.executable, "-c", code], env=os.environ | env, capture_output=True, text=True,
                          check=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a distill-data folder made for smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=256)
    args = parser.parse_args()
    machines = {"native": {}, "avx2 paths": AVX2}
    rates: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for machine, env in machines.items():
                for bf16 in (False, True):
                    key = f"{machine} {'bf16' if bf16 else 'fp32'}"
                    out = Path(tmp) / f"{key.replace(' ', '-')}-{round_}"
                    rates.setdefault(key, []).append(run(args, bf16, env, out))
                    print(f"{key}: {rates[key][-1]:.0f} response tokens/s", flush=True)
    summary = {key: round(sorted(values)[len(values) // 2], 1) for key, values in rates.items()}
    summary["auto"] = {machine: auto_choice(env) for machine, env in machines.items()}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
