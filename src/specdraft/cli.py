"""``specdraft`` command line: one subcommand per job, each building a config and calling one library function.

Every user error (bad value, unknown model, vocabulary mismatch, ...) ends with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from specdraft.api import DTYPES, encode_prompt, eos_token_ids, load_drafter, load_target, parse_dtype
from specdraft.decoding import GenerationConfig, generate
from specdraft.drafters import TRAINING_FREE
from specdraft.errors import SpecdraftError
from specdraft.sampling import SamplingConfig


def _prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecdraftError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise SpecdraftError("empty prompt: --prompt-ids has no ids")
    return ids


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text, speculatively when a drafter is given")
    p.add_argument("--target", required=True, help="built-in name, checkpoint folder or cached hub id")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--draft", help="draft model: built-in name, checkpoint folder or cached hub id")
    how.add_argument("--drafter", choices=sorted(TRAINING_FREE), help="training-free drafter")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="prompt text")
    what.add_argument("--prompt-ids", type=_prompt_ids, help="prompt token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-draft-tokens", type=int, default=4, help="γ, draft tokens per target forward")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n", type=int, default=1, help="independent completions (seeds seed, seed+1, ...)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--backend", choices=("auto", "native", "hf"), default="auto")
    p.add_argument("--json", action="store_true", help="one JSON object per completion")
    p.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> None:
    if args.n < 1:
        raise SpecdraftError(f"--n must be >= 1, got {args.n}")
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    dtype = parse_dtype(args.dtype)
    target, tokenizer = load_target(args.target, dtype, args.backend)
    config = GenerationConfig(args.max_new_tokens, args.num_draft_tokens, sampling,
                              eos_token_ids(tokenizer, args.target), tuple(args.stop))
    drafter = load_drafter(target, tokenizer, args.draft, args.drafter, dtype, args.backend)
    ids = args.prompt_ids if args.prompt_ids is not None else encode_prompt(tokenizer, args.prompt, args.chat)
    for i in range(args.n):
        result = generate(target, ids, drafter, config, torch.Generator().manual_seed(args.seed + i), tokenizer)
        text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
        if args.json:
            record = {"token_ids": result.token_ids, "text": text, "finish_reason": result.finish_reason,
                      "stats": result.stats.to_dict()}
            print(json.dumps(record), flush=True)
        else:
            s = result.stats
            print(text, flush=True)
            print(f"[{s.new_tokens} tokens, {s.tokens_per_second:.1f} tokens/s, block efficiency "
                  f"{s.block_efficiency:.2f}, {result.finish_reason}]", file=sys.stderr)


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="SmolLM2-135M-Instruct on built-in chat prompts, plain vs each drafter")
    p.add_argument("--draft", help="also run this draft model")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> None:
    from specdraft.demo import DemoConfig, run_demo

    if args.num_prompts < 1:
        raise SpecdraftError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    GenerationConfig(args.max_new_tokens, args.num_draft_tokens)  # validates both
    run_demo(DemoConfig(draft=args.draft, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                        num_draft_tokens=args.num_draft_tokens, dtype=parse_dtype(args.dtype)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdraft", description="Lossless speculative decoding for chat LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_demo(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except SpecdraftError as exc:
        print(f"specdraft: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
