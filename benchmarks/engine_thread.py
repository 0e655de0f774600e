"""Decoding in the server's engine thread against decoding in the thread that loaded the model: one chat prompt, 128
tokens, plain decoding on the built-in SmolLM2's GGUF blocks, alternating round by round:

- ``decoder``: :class:`~specdraft.batching.BatchDecoder` steps in this (the loading) thread;
- ``engine``: the same through :class:`~specdraft.serve.engine.Engine` (its decoding thread, events to asyncio);
- ``engine, workers kept``: the same, with this thread's OpenMP workers made again after the engine started (a
  parallel region here), as they were before :func:`~specdraft.hardware.release_openmp_workers`.

    python benchmarks/engine_thread.py [--rounds 4]

Prints the median seconds of each.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from specdraft.api import encode_prompt, load_target
from specdraft.batching import BatchDecoder
from specdraft.models.registry import SMOLLM2
from specdraft.sequence import GenerationConfig
from specdraft.serve.engine import Engine, Request


async def _answer(engine: Engine, ids: list[int], config: GenerationConfig) -> float:
    request = Request(ids, config, loop=asyncio.get_running_loop(), events=asyncio.Queue())
    start = time.perf_counter()
    engine.submit(request)
    while (await request.events.get()).finish_reason is None:
        pass
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    target, tokenizer = load_target(SMOLLM2, quantize="gguf")
    ids = encode_prompt(tokenizer, "Write a long story about a dragon who learns to code.", chat=True)
    config = GenerationConfig(128)
    decoder = BatchDecoder(target, 1, 512)
    seconds: dict[str, list[float]] = {"decoder": [], "engine": [], "engine, workers kept": []}

    def direct() -> float:
        start = time.perf_counter()
        seq = decoder.add(ids, None, config)
        while seq.finish_reason is None:
            decoder.step()
        return time.perf_counter() - start

    def through_engine(keep_workers: bool) -> float:
        engine = Engine(target, tokenizer, lambda: None, 1, 512, 4)
        engine.start()
        if keep_workers:
            big = torch.randn(1 << 22)
            torch.add(big, big)  # a parallel region in this thread: its pool's workers again
        try:
            return asyncio.run(_answer(engine, ids, config))
        finally:
            engine.stop()

    direct()  # warm-up
    for _ in range(args.rounds):
        seconds["decoder"].append(direct())
        seconds["engine"].append(through_engine(False))
        seconds["engine, workers kept"].append(through_engine(True))
    print(f"{torch.get_num_threads()} threads, {args.rounds} rounds, 128 tokens; median seconds")
    for name, values in seconds.items():
        print(f"{name}: {statistics.median(values):.3f}")


if __name__ == "__main__":
    main()
