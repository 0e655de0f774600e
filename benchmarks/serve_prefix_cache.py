"""What prefix caching saves the server's engine on chat conversations: each conversation asks Spec-Bench questions
one after another as its turns (the model's answers in between, as a chat client resends them), through the
engine behind ``specdraft serve`` (continuous batching, :class:`~specdraft.serve.engine.Engine`) with prefix caching
switched on and off, alternating conversation by conversation (the order swapped every other one); one engine, as
a server has (a second engine's idle thread would keep OpenMP workers that slow the first). Per turn: the time to
the first token (prefill and the first step) and to the last; answers must be equal.

    python benchmarks/serve_prefix_cache.py --questions ../shared/data/spec_bench/question.jsonl

The target is the built-in SmolLM2 on its GGUF blocks; plain decoding unless ``--draft`` names a draft model.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import time

import torch

from specdraft.api import eos_token_ids, load_drafter, load_target
from specdraft.batching import drafter_factory
from specdraft.bench.questions import conversation_ids, load_questions, select_questions
from specdraft.models.registry import SMOLLM2
from specdraft.serve.config import ServeConfig
from specdraft.serve.engine import Engine, Request


async def _turn(engine: Engine, ids: list[int], config) -> tuple[list[int], float, float, int]:
    """One request: (tokens, seconds to its first tokens, seconds to its end, prompt tokens read from the cache)."""
    request = Request(ids, config, loop=asyncio.get_running_loop(), events=asyncio.Queue())
    start = time.perf_counter()
    engine.submit(request)
    tokens, first = [], None
    while True:
        event = await request.events.get()
        if event.error:
            raise RuntimeError(event.error)
        if event.tokens and first is None:
            first = time.perf_counter() - start
        tokens += event.tokens
        if event.finish_reason is not None:
            return tokens, first or 0.0, time.perf_counter() - start, request.prompt_tokens_cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", required=True, help="a Spec-Bench question.jsonl")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4, help="questions asked one after another in a conversation")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--draft", help="a draft model (built-in name or folder); default plain decoding")
    args = parser.parse_args()
    target, tokenizer = load_target(SMOLLM2, quantize="gguf")
    drafter = load_drafter(target, tokenizer, args.draft) if args.draft else None
    wanted = args.conversations * args.turns
    questions = select_questions(load_questions(args.questions), per_category=math.ceil(wanted / 6))
    random.Random(0).shuffle(questions)  # each conversation's turns from several subtasks
    serve = ServeConfig(target=SMOLLM2, max_batch=2)
    config = serve.generation(args.max_tokens, eos_token_ids=eos_token_ids(tokenizer))
    capacity = 2048
    make = drafter_factory(drafter)
    engine = Engine(target, tokenizer, make, 2, capacity, 8)
    engine.start()
    times: dict[bool, list[tuple[int, float, float, int]]] = {True: [], False: []}
    answers: dict[bool, list[list[int]]] = {True: [], False: []}

    async def conversation(use: bool, turns: list[str]) -> None:
        texts: list[str] = []
        for number in range(len(turns)):
            ids = conversation_ids(tokenizer, turns[: number + 1], texts)
            if len(ids) + args.max_tokens > capacity:
                break
            engine.decoder.reuse = use
            tokens, first, last, cached = await _turn(engine, ids, config)
            times[use].append((number, first, last, cached))
            answers[use].append(tokens)
            texts.append(tokenizer.decode(tokens, skip_special_tokens=True).strip())

    async def run() -> None:
        await _turn(engine, conversation_ids(tokenizer, ["Say hello."], []), config)  # warm-up: no conversation's
        for i in range(args.conversations):
            turns = [q.turns[0] for q in questions[i * args.turns : (i + 1) * args.turns]]
            for use in (True, False) if i % 2 == 0 else (False, True):
                await conversation(use, turns)

    try:
        asyncio.run(run())
    finally:
        engine.stop()
    print(f"{args.conversations} conversations of up to {args.turns} turns, {args.max_tokens} tokens a turn, "
          f"{torch.get_num_threads()} threads; medians (seconds) by turn, prefix cache off / on")
    print("turn | turns | prompt tokens read from the cache (on) | first token off | on | last token off | on")
    for number in range(args.turns):
        on = [t for t in times[True] if t[0] == number]
        off = [t for t in times[False] if t[0] == number]
        if on and off:
            print(f"{number + 1} | {len(on)} | {statistics.median(t[3] for t in on):.0f} | "
                  f"{statistics.median(t[1] for t in off):.3f} | {statistics.median(t[1] for t in on):.3f} | "
                  f"{statistics.median(t[2] for t in off):.3f} | {statistics.median(t[2] for t in on):.3f}")
    total = {use: sum(t[2] for t in times[use]) for use in times}
    print(f"all turns: off {total[False]:.2f} s, on {total[True]:.2f} s; "
          f"answers equal: {answers[True] == answers[False]}")


if __name__ == "__main__":
    main()
