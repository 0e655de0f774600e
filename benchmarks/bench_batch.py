"""Tokens/s of batched decoding against batch size, plain and speculative, on the real target.

Every batch size runs, in turn in one process, plain decoding and speculative decoding with the shipped drafter (one
instance per row), its draft forwards batched across rows (lockstep) and one row after another, on the built-in
chat prompts repeated to fill the batch; tokens/s counts every generated token of the batch over the wall time of
the whole batch (prefill included).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_batch.py [--dtype bfloat16|auto] [--batch-sizes 1,2,4,8,16,32]
        [--speculation adaptive|fixed]

Prints a table and one JSON line with every number.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from specdraft.api import encode_prompt, eos_token_ids, load_drafter, load_target, parse_dtype
from specdraft.batch_drafting import lockstep_factory
from specdraft.batching import drafter_factory, generate_batch
from specdraft.models.registry import SMOLLM2, SMOLLM2_DRAFTER, choose_precision
from specdraft.prompts import BUILTIN_PROMPTS
from specdraft.sequence import GenerationConfig
from specdraft.speculation import SPECULATION


def _run(target, prompts, make, config) -> dict:
    start = time.perf_counter()
    results = generate_batch(target, prompts, make, config)
    seconds = time.perf_counter() - start
    tokens = sum(r.stats.new_tokens for r in results)
    steps = max(r.stats.target_forward_calls for r in results)
    proposed = sum(r.stats.draft_tokens_proposed for r in results)
    accepted = sum(r.stats.draft_tokens_accepted for r in results)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds, "steps": steps,
            "block_efficiency": tokens / sum(r.stats.target_forward_calls for r in results),
            "acceptance_rate": accepted / proposed if proposed else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", help="auto: the server's default, the GGUF's own blocks")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--draft", default=SMOLLM2_DRAFTER)
    parser.add_argument("--speculation", choices=SPECULATION, default="adaptive", help="the rows' speculation policy")
    args = parser.parse_args()
    precision = choose_precision(SMOLLM2, args.dtype, "auto", parse_dtype("bfloat16"))
    target, tokenizer = load_target(SMOLLM2, precision.dtype, quantize=precision.quantize)
    prototype = load_drafter(target, tokenizer, draft=args.draft, dtype=precision.draft_dtype)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    one_by_one = drafter_factory(prototype)
    config = GenerationConfig(args.max_new_tokens, args.num_draft_tokens,
                              eos_token_ids=eos_token_ids(tokenizer, SMOLLM2), speculation=args.speculation)
    prompts = [encode_prompt(tokenizer, p.text, chat=True) for p in BUILTIN_PROMPTS]
    capacity = max(len(ids) for ids in prompts) + args.max_new_tokens + 64
    lockstep = lockstep_factory(prototype, 2 * max(sizes) + 2, capacity, one_by_one)
    generate_batch(target, prompts[:2], None, GenerationConfig(4))  # warm-up
    rows = []
    for size in sizes:
        batch = [prompts[i % len(prompts)] for i in range(size)]
        plain = _run(target, batch, None, config)
        spec = _run(target, batch, lockstep, config)
        serial = _run(target, batch, one_by_one, config)
        rows.append({"batch_size": size, "plain": plain, "speculative": spec, "speculative_one_by_one": serial})
        print(f"batch {size:3d}: plain {plain['tokens_per_second']:7.1f} tokens/s, speculative "
              f"{spec['tokens_per_second']:7.1f} tokens/s (τ {spec['block_efficiency']:.2f}, "
              f"{spec['tokens_per_second'] / plain['tokens_per_second']:.2f}x), drafting one row at a time "
              f"{serial['tokens_per_second']:7.1f} tokens/s", flush=True)
    print(json.dumps({"dtype": args.dtype, "cpu": torch.backends.cpu.get_cpu_capability(),
                      "threads": torch.get_num_threads(), "machine": platform.machine(), "draft": args.draft,
                      "max_new_tokens": args.max_new_tokens, "num_draft_tokens": args.num_draft_tokens,
                      "speculation": args.speculation, "rows": rows}))


if __name__ == "__main__":
    main()
