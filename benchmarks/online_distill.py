"""Online distillation on a stream from a domain the shipped drafter was not trained on: Python code completion.

The shipped drafter was distilled on the target's answers to ShareGPT first turns and task prompts (chat, mostly
English prose). The stream here is raw code completion (no chat template): the opening lines of functions from the
Python standard library's own sources on this machine (header, docstring, first body lines), in a fixed shuffled
order, completed greedily by the target.

Two passes over the same stream through the server's engine (continuous batching, lockstep drafting), greedy fp32:
with ``--online-distill`` (the drafter is retrained in the background and swapped in when better) and without. It
prints the acceptance rate (accepted / proposed draft tokens) and τ over each fifth of the stream for both passes,
the ratio last fifth / first fifth, and whether every completion is identical between the passes. The pass
without online distillation is the control: its fifths differ only by their prompts. Ends by itself.

    OMP_NUM_THREADS=1 python benchmarks/online_distill.py --prompts 60 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from specdraft.api import eos_token_ids, load_target
from specdraft.batch_drafting import lockstep_factory
from specdraft.batching import drafter_factory
from specdraft.drafters import load_drafter, parse_options
from specdraft.sequence import GenerationConfig
from specdraft.serve.engine import Engine, Request
from specdraft.serve.online import OnlineDistiller
from specdraft.serve.online_config import OnlineDistillConfig


def code_prompts(count: int, max_lines: int, seed: int) -> list[str]:
    """Openings of top-level functions and methods with a docstring from the standard library's sources."""
    root = Path(os.__file__).parent
    found = []
    for path in sorted(root.glob("*.py")) + sorted(root.glob("[a-z]*/*.py")):
        if "test" in path.parts[-2] or path.name.startswith("test"):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node) and node.end_lineno - node.lineno > 8:
                body = lines[node.lineno - 1 : min(node.end_lineno, node.body[0].end_lineno + 3, node.lineno - 1
                                                    + max_lines)]
                indent = len(body[0]) - len(body[0].lstrip())
                text = "\n".join(line[indent:] for line in body) + "\n"
                if 80 <= len(text) <= 1200:
                    found.append(text)
    random.Random(seed).shuffle(found)
    return found[:count]


class RecordingEngine(Engine):
    """The server's engine, keeping each finished sequence's statistics for the report."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.finished_stats: dict[int, object] = {}

    def _finished(self, seq) -> None:
        super()._finished(seq)
        self.finished_stats[id(seq.tag[0])] = seq.stats


async def _stream(engine: RecordingEngine, prompts: list[list[int]], config: GenerationConfig, concurrency: int):
    loop, order, results = asyncio.get_running_loop(), iter(range(len(prompts))), [None] * len(prompts)

    async def worker() -> None:
        for i in order:
            request = Request(prompts[i], config, loop=loop, events=asyncio.Queue())
            engine.submit(request)
            tokens = []
            while True:
                event = await request.events.get()
                if event.error:
                    raise RuntimeError(event.error)
                tokens += event.tokens
                if event.finish_reason is not None:
                    break
            while id(request) not in engine.finished_stats:  # the last event may arrive before the bookkeeping
                await asyncio.sleep(0.01)
            results[i] = (tokens, engine.finished_stats.pop(id(request)))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def stream_all(engine: RecordingEngine, prompts: list[list[int]], config: GenerationConfig,
               concurrency: int) -> tuple[list, float]:
    """Start ``engine``, serve every prompt with ``concurrency`` clients, stop it: (results, wall seconds)."""
    engine.start()
    started = time.perf_counter()
    try:
        results = asyncio.run(_stream(engine, prompts, config, concurrency))
    finally:
        engine.stop()
    return results, time.perf_counter() - started


def serve_pass(target, tokenizer, prototype, prompts, args, online: OnlineDistillConfig | None):
    capacity = max(len(p) for p in prompts) + args.max_new_tokens

    def factory(drafter):
        return lockstep_factory(drafter, 2 * args.concurrency + 2, capacity + 64, drafter_factory(drafter))

    distiller = None
    if online is not None:
        distiller = OnlineDistiller(online, prototype, args.draft, factory, tokenizer.eos_token_id)
    engine = RecordingEngine(target, tokenizer, factory(prototype), args.concurrency, capacity, len(prompts), 0,
                             distiller)
    config = GenerationConfig(args.max_new_tokens, args.num_draft_tokens, eos_token_ids=eos_token_ids(tokenizer))
    results, seconds = stream_all(engine, prompts, config, args.concurrency)
    return results, seconds, (distiller.history if distiller else [])


def fifths(results) -> list[dict]:
    size = len(results) // 5
    rows = []
    for k in range(5):
        part = [stats for _, stats in results[k * size : (k + 1) * size]]
        accepted, proposed = sum(s.draft_tokens_accepted for s in part), sum(s.draft_tokens_proposed for s in part)
        tokens, calls = sum(s.new_tokens for s in part), sum(s.target_forward_calls for s in part)
        rows.append({"acceptance": accepted / max(proposed, 1), "tau": tokens / max(calls, 1), "tokens": tokens})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default="smollm2-135m-instruct-drafter")
    parser.add_argument("--drafter-options", default="prompt_lookup=0,prompt_lookup_alone=0,confidence_threshold=0",
                        help="KEY=VALUE,... over the drafter's own (default: its model's chain alone, γ fixed)")
    parser.add_argument("--prompts", type=int, default=60)
    parser.add_argument("--max-lines", type=int, default=14)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--loss", default="fkl")
    parser.add_argument("--every-tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--nice", type=int, default=0, help="trainer niceness (0: the machine is shared)")
    parser.add_argument("--out", help="online distillation folder (default: a temporary one, deleted)")
    parser.add_argument("--json", help="write the numbers here too")
    args = parser.parse_args()
    torch.manual_seed(0)
    texts = code_prompts(args.prompts, args.max_lines, seed=0)
    target, tokenizer = load_target(args.target, torch.float32)
    options = parse_options([o for o in args.drafter_options.split(",") if o])
    prototype = load_drafter(target, tokenizer, args.draft, options=options)
    prompts = [tokenizer(text)["input_ids"] for text in texts]
    print(f"{len(prompts)} code prompts, {sum(map(len, prompts)) / len(prompts):.0f} tokens on average; "
          f"{args.max_new_tokens} new tokens each, γ {args.num_draft_tokens}, fp32 greedy, "
          f"{torch.get_num_threads()} thread(s), CPU {torch.backends.cpu.get_cpu_capability()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        online = OnlineDistillConfig(folder=args.out or tmp, loss=args.loss, every_tokens=args.every_tokens,
                                     steps=args.steps, lr=args.lr, nice=args.nice)
        learned, learned_s, history = serve_pass(target, tokenizer, prototype, prompts, args, online)
    print(f"online pass: {learned_s:.0f} s; rounds: " + json.dumps(history), flush=True)
    plain, plain_s, _ = serve_pass(target, tokenizer, prototype, prompts, args, None)
    identical = sum(a[0] == b[0] for a, b in zip(learned, plain, strict=True))
    report = {"online": fifths(learned), "without": fifths(plain), "identical": identical, "prompts": len(prompts),
              "online_seconds": learned_s, "without_seconds": plain_s, "rounds": history}
    print("fifth | acceptance online | acceptance without | τ online | τ without")
    for k in range(5):
        on, off = report["online"][k], report["without"][k]
        print(f"{k + 1} | {on['acceptance']:.3f} | {off['acceptance']:.3f} | {on['tau']:.2f} | {off['tau']:.2f}")
    for name in ("online", "without"):
        rows = report[name]
        print(f"{name}: acceptance last/first fifth {rows[4]['acceptance'] / max(rows[0]['acceptance'], 1e-9):.2f}x, "
              f"τ {rows[4]['tau'] / rows[0]['tau']:.2f}x")
    print(f"identical completions: {identical} of {len(prompts)}; tokens/s online "
          f"{sum(len(r[0]) for r in learned) / learned_s:.2f}, without {sum(len(r[0]) for r in plain) / plain_s:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    sys.exit(0 if identical == len(prompts) else 1)


if __name__ == "__main__":
    main()
