"""Distillation-data generation speed on the real target: prompts/minute and generated tokens/s, batch 1 vs batched
(left padding), same prompts, same settings, in one process.

    .venv/bin/python benchmarks/bench_distill_data.py [--prompts 16] [--max-new-tokens 64] [--batch-sizes 1,16]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specdraft.models.registry import SMOLLM2, load_model, load_tokenizer
from specdraft.training.data import sharegpt_prompts
from specdraft.training.generation import DistillDataConfig, generate_shard


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    model = load_model(SMOLLM2, getattr(torch, args.dtype), backend="hf").model
    tokenizer = load_tokenizer(SMOLLM2)
    prompts = [(r.id, r.messages()) for r in sharegpt_prompts(split="train", limit=args.prompts)]
    rows = {}
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        config = DistillDataConfig(target=SMOLLM2, out="-", max_new_tokens=args.max_new_tokens, temperature=1.0,
                                   batch_size=batch_size, dtype=args.dtype)
        generate_shard(model, tokenizer, prompts[:2], config, seed=1)  # warm-up
        start = time.perf_counter()
        records = generate_shard(model, tokenizer, prompts, config, seed=0)
        seconds = time.perf_counter() - start
        tokens = sum(len(r["response_token_ids"]) for r in records)
        rows[batch_size] = {"prompts_per_minute": round(60 * len(prompts) / seconds, 1),
                            "tokens_per_second": round(tokens / seconds, 1), "tokens": tokens,
                            "seconds": round(seconds, 1)}
        print(f"batch {batch_size:>3}: {rows[batch_size]['prompts_per_minute']:>6.1f} prompts/min, "
              f"{rows[batch_size]['tokens_per_second']:>6.1f} tokens/s ({tokens} tokens in {seconds:.1f} s)")
    print(json.dumps({"target": SMOLLM2, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
                      "threads": torch.get_num_threads(), "batches": rows}))


if __name__ == "__main__":
    main()
