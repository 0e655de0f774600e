"""Plain decoding against drafters (the shipped draft model, training-free ones, the shipped EAGLE-3 heads) on the
built-in prompts: tokens per CPU second and identity to plain decoding, in one dtype, on the linear path the loader
picks on this CPU (``SPECDRAFT_PREPACK=rows|onednn`` asks for one).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/decode_paths.py --dtype bfloat16
    SPECDRAFT_ROWGEMM=0 OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/decode_paths.py   # without the rows kernel

Run it twice: the first run also measures the cost curves adaptive speculation needs (cached afterwards). Methods
alternate within each prompt; CPU time (one thread) is robust to other processes on a shared CPU.
"""

from __future__ import annotations

import argparse
import time

import torch

from specdraft.api import encode_prompt, eos_token_ids, load_target, parse_dtype
from specdraft.decoding import generate
from specdraft.drafters import load_drafter
from specdraft.models.registry import SMOLLM2, SMOLLM2_DRAFTER
from specdraft.prompts import BUILTIN_PROMPTS
from specdraft.sequence import GenerationConfig


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--methods", default="draft,prompt-lookup",
                        help="comma-separated: draft (the shipped draft model) or a training-free drafter name")
    args = parser.parse_args()
    dtype = parse_dtype(args.dtype)
    target, tokenizer = load_target(SMOLLM2, dtype)
    print(f"{torch.backends.cpu.get_cpu_capability()} {args.dtype}, linears: {target.packing}", flush=True)
    methods = {"plain": None}
    for name in args.methods.split(","):
        methods[name] = (load_drafter(target, tokenizer, draft=SMOLLM2_DRAFTER, dtype=dtype) if name == "draft"
                         else load_drafter(target, tokenizer, drafter=name))
    config = GenerationConfig(args.max_new_tokens, 4, eos_token_ids=eos_token_ids(tokenizer, SMOLLM2))
    seconds, tokens, identical = ({name: 0 for name in methods} for _ in range(3))
    for prompt in BUILTIN_PROMPTS[: args.prompts]:
        ids, plain = encode_prompt(tokenizer, prompt.text, chat=True), None
        for name, drafter in methods.items():
            tick = time.process_time()
            out = generate(target, ids, drafter, config).token_ids
            seconds[name] += time.process_time() - tick
            tokens[name] += len(out)
            plain = out if plain is None else plain
            identical[name] += out == plain
    base = tokens["plain"] / seconds["plain"]
    for name in methods:
        rate = tokens[name] / seconds[name]
        print(f"{name:<14}{rate:8.1f} tokens/s  {rate / base:5.2f}x  identical to plain {identical[name]}/"
              f"{args.prompts}", flush=True)


if __name__ == "__main__":
    main()
