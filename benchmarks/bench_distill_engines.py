"""Distillation data from specdraft's native engine and from vLLM on the same prompts, in one process: answer
tokens/s of each (generation only, and with the engine's start), and whether the records agree in format.

    .venv/bin/python benchmarks/bench_distill_engines.py --out runs/engines [--limit 64] [--max-new-tokens 256]
        [--dtype bfloat16] [--top-logprobs 8] [--engines native,vllm]

Each engine writes a complete ``distill-data`` folder (``OUT/native``, ``OUT/vllm``) through
:func:`specdraft.training.data.distill_data.generate_distillation_data`, with the model (or vLLM's engine) started first
and timed apart. Prints one JSON line: per engine the start seconds, generation seconds, answer tokens, tokens/s;
then the record fields of each engine, and how many answers are token-identical across the engines.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdraft.models.registry import SMOLLM2, load_model, load_tokenizer, parse_dtype
from specdraft.training.data.distill_data import DistillDataConfig, generate_distillation_data, load_prompts


def _records(folder: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(folder.glob("shard-*.jsonl")) for line in path.open()]


def _start(config: DistillDataConfig):
    """The model, or vLLM's engine, for ``config``: (models tuple, closer)."""
    tokenizer = load_tokenizer(config.target)
    if config.engine == "vllm":
        from specdraft.training.data.vllm_generation import start_engine

        engine = start_engine(config)
        return (engine, tokenizer, None), engine.close
    model = load_model(config.target, parse_dtype(config.dtype), backend="native")
    return (model, tokenizer, None), lambda: None


def run(engine: str, args: argparse.Namespace) -> dict:
    config = DistillDataConfig(target=args.target, out=str(Path(args.out) / engine), prompts=args.prompts,
                               limit=args.limit, max_new_tokens=args.max_new_tokens, temperature=0.0,
                               top_logprobs=args.top_logprobs, batch_size=args.limit, shard_size=args.limit,
                               dtype=args.dtype, engine=engine)
    started = time.perf_counter()
    models, close = _start(config)
    start_seconds = time.perf_counter() - started
    try:
        began = time.perf_counter()
        manifest = generate_distillation_data(config, overwrite=True, progress=False, models=models,
                                              prompts=load_prompts(config))
        seconds = time.perf_counter() - began
    finally:
        close()
    tokens = sum(len(r["response_token_ids"]) for r in _records(Path(config.out)))
    return {"start_seconds": round(start_seconds, 1), "generate_seconds": round(seconds, 1), "answer_tokens": tokens,
            "tokens_per_second": round(tokens / seconds, 1),
            "tokens_per_second_with_start": round(tokens / (seconds + start_seconds), 1),
            "records": manifest["records"], "complete": manifest["complete"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--target", default=SMOLLM2)
    parser.add_argument("--prompts", default="sharegpt")
    parser.add_argument("--limit", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--top-logprobs", type=int, default=8)
    parser.add_argument("--engines", default="native,vllm")
    args = parser.parse_args()
    engines = args.engines.split(",")
    rows = {engine: run(engine, args) for engine in engines}
    for engine, row in rows.items():
        print(f"{engine:>7}: start {row['start_seconds']:6.1f} s, {row['answer_tokens']} answer tokens in "
              f"{row['generate_seconds']:6.1f} s = {row['tokens_per_second']:7.1f} tokens/s "
              f"({row['tokens_per_second_with_start']:.1f} with the start)", flush=True)
    records = {engine: _records(Path(args.out) / engine) for engine in engines}
    fields = {engine: sorted(rs[0]) for engine, rs in records.items()}
    summary = {"target": args.target, "dtype": args.dtype, "prompts": args.limit, "max_new_tokens": args.max_new_tokens,
               "top_logprobs": args.top_logprobs, "threads": torch.get_num_threads(), "engines": rows,
               "fields": fields, "same_fields": len({tuple(f) for f in fields.values()}) == 1}
    if len(engines) == 2:
        a, b = (records[e] for e in engines)
        pairs = zip(a, b, strict=True)
        summary["identical_answers"] = sum(x["response_token_ids"] == y["response_token_ids"] for x, y in pairs)
        summary["same_prompts_in_order"] = [r["prompt_id"] for r in a] == [r["prompt_id"] for r in b]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
