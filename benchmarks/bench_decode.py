"""Decode speed on the real target: specdraft's native path vs transformers' ``generate``, and prompt lookup vs plain
decoding on summarization-style prompts. Methods run alternately in one process (timings drift 20-30% between runs).

    .venv/bin/python benchmarks/bench_decode.py [--dtype bfloat16] [--max-new-tokens 128] [--rounds 3]

Prints a table and one JSON line with every number.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections import defaultdict

import torch
import transformers

from specdraft.api import encode_prompt, eos_token_ids, load_target, parse_dtype
from specdraft.decoding import generate
from specdraft.drafters import PromptLookupDrafter
from specdraft.models.registry import SMOLLM2, load_model
from specdraft.prompts import BUILTIN_PROMPTS
from specdraft.sequence import GenerationConfig


def _hf_generate(model, ids: list[int], max_new: int, eos: tuple[int, ...]) -> tuple[int, float]:
    start = time.perf_counter()
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new, eos_token_id=list(eos),
                         pad_token_id=eos[0])
    return out.shape[1] - len(ids), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    args = parser.parse_args()
    dtype = parse_dtype(args.dtype)
    native, tokenizer = load_target(SMOLLM2, dtype)
    hf = load_model(SMOLLM2, dtype, backend="hf").model
    eos = eos_token_ids(tokenizer, SMOLLM2)
    config = GenerationConfig(args.max_new_tokens, args.num_draft_tokens, eos_token_ids=eos)
    prompts = {p.category: [] for p in BUILTIN_PROMPTS}
    for p in BUILTIN_PROMPTS:
        prompts[p.category].append(encode_prompt(tokenizer, p.text, chat=True))
    everything = [ids for group in prompts.values() for ids in group]
    methods = {
        "specdraft native (plain)": lambda ids: _ours(native, ids, None, config),
        "transformers generate": lambda ids: _hf_generate(hf, ids, args.max_new_tokens, eos),
    }
    lookup = {
        "plain": lambda ids: _ours(native, ids, None, config),
        "prompt-lookup": lambda ids: _ours(native, ids, PromptLookupDrafter(), config),
    }
    _ours(native, everything[0], None, GenerationConfig(8))  # warm-up
    _hf_generate(hf, everything[0], 8, eos)
    speed = _alternate(methods, everything, args.rounds)
    summ = _alternate(lookup, prompts["summarization"] + prompts["rag"], args.rounds)
    report = {"setup": {"target": SMOLLM2, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
                        "num_draft_tokens": args.num_draft_tokens, "rounds": args.rounds,
                        "torch": torch.__version__, "transformers": transformers.__version__,
                        "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine()},
              "all_prompts": speed, "summarization_and_rag": summ}
    _print(report)
    print(json.dumps(report))


def _ours(model, ids, drafter, config) -> tuple[int, float]:
    result = generate(model, ids, drafter, config)
    return result.stats.new_tokens, result.stats.decode_seconds


def _alternate(methods: dict, prompts: list[list[int]], rounds: int) -> dict:
    """Run every method on every prompt, interleaved, ``rounds`` times; tokens/s from summed tokens and seconds."""
    tokens, seconds = defaultdict(int), defaultdict(float)
    for _ in range(rounds):
        for ids in prompts:
            for name, run in methods.items():
                n, s = run(ids)
                tokens[name] += n
                seconds[name] += s
    return {name: {"tokens": tokens[name], "seconds": round(seconds[name], 3),
                   "tokens_per_second": round(tokens[name] / seconds[name], 2)} for name in methods}


def _print(report: dict) -> None:
    setup = report["setup"]
    print(f"{setup['target']} {setup['dtype']}, batch 1, greedy, {setup['threads']} threads, "
          f"max_new_tokens {setup['max_new_tokens']}, {setup['rounds']} rounds, interleaved")
    for section, rows in (("all built-in prompts", report["all_prompts"]),
                          ("summarization + rag prompts", report["summarization_and_rag"])):
        first = next(iter(rows.values()))["tokens_per_second"]
        print(f"\n{section}:")
        for name, row in rows.items():
            print(f"  {name:<28}{row['tokens_per_second']:>8.1f} tokens/s  {row['tokens_per_second'] / first:.2f}x")


if __name__ == "__main__":
    main()
