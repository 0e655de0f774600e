"""What a draft-model forward pays for after a target step: the same 1-token drafter forward timed after different
work, the kinds alternating within each round, in one process.

- ``target step``: a 1-token forward of the target (its 96 MB of blocks stream through the caches);
- ``drafter forward``: another drafter forward (its 12.5 MB of blocks and its cache still warm);
- ``drafter + stream N MB (huge pages)`` / ``(4 KiB pages)``: a drafter forward, then a sum over N MB of memory in
  2 MiB or in 4 KiB pages (the caches emptied, the TLB kept or emptied);
- ``drafter + touch 16k pages``: a drafter forward, then one cache line read from each of 16,384 4 KiB pages (the
  TLB emptied, the caches barely touched);
- ``target step + re-read xK``: a target step, then the drafter's block products run K times on dummy rows (its
  weights read back into the caches, split between the threads as its forward splits them).

    python benchmarks/drafter_cold.py [--rounds 40] [--context 300]

The drafter's forward is also split into its parts (the fused layers, the LM head over its vocabulary rows, the
rest: Python and torch's small ops).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import numpy as np
import torch

import specdraft.models.quantized as Q
from specdraft.api import load_target
from specdraft.drafters import load_drafter
from specdraft.drafters.combined import draft_model_of
from specdraft.hardware import cpu_model
from specdraft.models.hugepages import huge_page_copies
from specdraft.models.registry import SMOLLM2, SMOLLM2_DRAFTER

PARTS = ("fused_layers", "linear")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--context", type=int, default=300, help="cached tokens of the target and of the drafter")
    parser.add_argument("--stream-mb", type=int, default=96, help="megabytes the streaming kinds read")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(SMOLLM2, quantize="gguf")
    drafter = load_drafter(target, tokenizer, draft=SMOLLM2_DRAFTER)
    inner = draft_model_of(drafter)
    model, rows = inner.model, inner._rows  # the draft model and its vocabulary's head rows
    target_cache, draft_cache = target.new_cache(args.context + 16), model.new_cache(args.context + 16)
    ids = torch.randint(100, 40000, (1, args.context))
    target.forward(ids, target_cache, logits_to_keep=1)
    model.forward(ids, draft_cache, logits_to_keep=1, logits_weight=rows)

    huge = huge_page_copies([torch.ones(args.stream_mb << 20, dtype=torch.uint8)])[0].view(torch.int64)
    small = torch.ones(args.stream_mb << 20, dtype=torch.uint8).view(torch.int64)
    pages = np.ones(64 << 20, dtype=np.uint8)  # 16,384 pages of 4 KiB
    weights = [layer.quantized[name] for layer in model.layers for name in ("qkv", "o", "gate_up", "down")]
    weights.append(model._head_rows(rows))  # its vocabulary's head rows, as its forward multiplies them
    products = [(weight, torch.randn(1, weight.in_features)) for weight in weights]

    def target_step():
        target.forward(torch.tensor([[42]]), target_cache)

    def drafter_forward():
        model.forward(torch.tensor([[43]]), draft_cache, logits_weight=rows)

    def reread(times: int):
        target_step()
        for _ in range(times):
            for weight, x in products:
                Q.linear(x, weight)

    before = {"target step": target_step, "drafter forward": drafter_forward,
              f"drafter + stream {args.stream_mb} MB (huge pages)": lambda: (drafter_forward(), huge.sum()),
              f"drafter + stream {args.stream_mb} MB (4 KiB pages)": lambda: (drafter_forward(), small.sum()),
              "drafter + touch 16k pages": lambda: (drafter_forward(), pages[::4096].sum()),
              "target step + re-read x1": lambda: reread(1), "target step + re-read x2": lambda: reread(2)}

    current: list[str | None] = [None]
    parts: dict = collections.defaultdict(list)
    originals = {name: getattr(Q, name) for name in PARTS}

    def timed(name):
        def call(*a, **k):
            start = time.perf_counter()
            out = originals[name](*a, **k)
            if current[0] is not None:
                parts[current[0], name].append(time.perf_counter() - start)
            return out
        return call

    for name in PARTS:
        setattr(Q, name, timed(name))
    forward: dict = collections.defaultdict(list)
    work: dict = collections.defaultdict(list)
    with torch.inference_mode():
        for round_ in range(args.rounds):
            kinds = list(before) if round_ % 2 == 0 else list(before)[::-1]
            for kind in kinds:
                start = time.perf_counter()
                before[kind]()
                work[kind].append(time.perf_counter() - start)
                current[0] = kind
                start = time.perf_counter()
                drafter_forward()
                forward[kind].append(time.perf_counter() - start)
                current[0] = None
                target_cache.crop(args.context)
                draft_cache.crop(args.context)

    def ms(values) -> str:
        return f"{statistics.median(values) * 1e3:.3f}"

    print(f"# {cpu_model()}, {args.threads} threads, {args.context} cached tokens, medians of {args.rounds} rounds\n")
    print("| before the drafter forward | its work ms | drafter forward ms | fused layers ms | LM head ms |")
    print("|---|---|---|---|---|")
    for kind in before:
        print(f"| {kind} | {ms(work[kind])} | {ms(forward[kind])} | {ms(parts[kind, 'fused_layers'])} | "
              f"{ms(parts[kind, 'linear'])} |")


if __name__ == "__main__":
    main()
