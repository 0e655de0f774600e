"""Cost of a k-token verify against a 1-token step, per dtype and linear kernel path, on this CPU.

    PYTHONPATH=src python benchmarks/bench_verify_cost.py --dtypes float32,bfloat16
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        PYTHONPATH=src python benchmarks/bench_verify_cost.py   # the AVX2 paths on an AVX-512 CPU

Variants per dtype: ``eager`` (``F.linear``), ``onednn`` (oneDNN's packed layout; for bf16 where oneDNN has no bf16
kernel, an fp32 copy for 6+ rows), ``rows`` (the row-invariant AVX2 kernel, :mod:`specdraft.models.rowgemm`); the
one the loader picks on this CPU is marked ``*``. Every variant is a separate copy of the model; rounds alternate
between them and between
sizes (a shared CPU's load drifts), and the median of the rounds is printed: ms per forward at the given context
and the ratio to that variant's 1-token step. ``tree-N`` rows time an N-node verify through the explicit-mask path
(positions and a tree mask, as token-tree verification runs it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdraft.api import parse_dtype
from specdraft.costs import machine
from specdraft.models import packed as packing
from specdraft.models.native_llama import NativeLlama
from specdraft.models.registry import SMOLLM2, resolve


def _forward_seconds(model: NativeLlama, cache, ids: torch.Tensor, context: int, size: int, tree: bool,
                     clock=time.perf_counter) -> float:
    cache.crop(context)
    kwargs = {}
    if tree:  # a binary tree's mask and depths over the new tokens
        parents = [(i - 1) // 2 for i in range(size)]
        mask = torch.eye(size, dtype=torch.bool)
        depth = [0] * size
        for i in range(1, size):
            mask[i] |= mask[parents[i]]
            depth[i] = depth[parents[i]] + 1
        kwargs = {"positions": context + torch.tensor(depth), "attention_mask": mask}
    tick = clock()
    model.forward(ids[:, context : context + size], cache, **kwargs)
    return clock() - tick


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--sizes", default="1,2,3,4,5,8", help="new tokens per forward")
    parser.add_argument("--paths", default="eager,onednn,rows", help="linear kernel paths to compare")
    parser.add_argument("--trees", default="8,16", help="tree verify sizes (explicit-mask path)")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this process's CPU time (with OMP_NUM_THREADS=1, the compute a forward needs, "
                             "unaffected by other processes on a shared CPU)")
    parser.add_argument("--json", help="also write the table here")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    points = [(s, False) for s in sizes] + [(int(s), True) for s in args.trees.split(",") if s]
    print(json.dumps({**machine(), "clock": args.clock}), flush=True)
    variants = {}
    for name in args.dtypes.split(","):
        default = packing.pack(torch.zeros(8, 16, dtype=parse_dtype(name)))  # what the loader picks here
        chosen = "eager" if default is None else default.kind
        for kind in args.paths.split(","):
            model = NativeLlama.from_pretrained(resolve(args.model), dtype=parse_dtype(name), name=args.model)
            if kind != "eager" and (not model.prepack(kind) or model.packing != kind):
                print(f"{name}: no {kind} path on this CPU", flush=True)
                continue
            variants[f"{name} {kind}{'*' if kind == chosen else ''}"] = model
    top = args.context + max(s for s, _ in points)
    ids = torch.randint(0, 49152, (1, top), generator=torch.Generator().manual_seed(0))  # (1, L)
    caches = {}
    for label, model in variants.items():
        caches[label] = model.new_cache(top)
        model.forward(ids[:, : args.context], caches[label], logits_to_keep=1)
    times = {(label, point): [] for label in variants for point in points}
    for round_ in range(args.rounds + 1):
        for label, model in variants.items():
            for point in points:
                seconds = _forward_seconds(model, caches[label], ids, args.context, *point, clock=clock)
                if round_:  # the first round warms up
                    times[label, point].append(seconds)
    rows = []
    print(f"{'variant':<22}{'new tokens':>12}{'ms':>10}{'x 1-token step':>16}")
    for label in variants:
        step = statistics.median(times[label, (1, False)])
        for point in points:
            ms = statistics.median(times[label, point]) * 1e3
            kind = f"tree-{point[0]}" if point[1] else str(point[0])
            rows.append({"variant": label, "new_tokens": kind, "ms": ms, "ratio": ms / 1e3 / step})
            print(f"{label:<22}{kind:>12}{ms:>10.1f}{ms / 1e3 / step:>16.2f}", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": machine(), "context": args.context, "clock": args.clock, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
