"""What a background drafter trainer costs the server: serving tokens/s with no trainer, with one training in a thread
of the server's process, and with one training in a separate process, each at niceness 0 and 19, interleaved.

The trainer runs online distillation's optimizer steps (:func:`specdraft.serve.online_train.finetune_copy`) in a loop
on records of a replay buffer (``--buffer``, e.g. the folder ``online_distill.py --out`` leaves). The serving load is
greedy fp32 code completion through the server's engine, as in ``online_distill.py``. Ends by itself.

    OMP_NUM_THREADS=1 python benchmarks/online_trainer_cost.py --buffer runs/osd/buffer
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import threading
import time

import torch
from online_distill import RecordingEngine, code_prompts, stream_all

from specdraft.api import eos_token_ids, load_target
from specdraft.batch_drafting import lockstep_factory
from specdraft.batching import drafter_factory
from specdraft.drafters import load_drafter, parse_options
from specdraft.sequence import GenerationConfig
from specdraft.serve.online_train import finetune_copy, hf_from_native
from specdraft.serve.replay import ReplayBuffer


def train_forever(state: dict, records: list[dict], keep, pad_id: int, nice: int, stop, steps) -> None:
    """Optimizer steps on ``records`` until ``stop`` is set, counted in ``steps`` (a thread's or a process's
    body)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    if nice:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    model = LlamaForCausalLM(LlamaConfig(**state["config"])).float()
    model.load_state_dict(state["weights"], strict=False)
    model.get_input_embeddings().weight.requires_grad_(False)
    while not stop.is_set():
        finetune_copy(model, records, loss="fkl", steps=4, batch_size=4, lr=1e-4, max_seq_len=512, keep=keep,
                      pad_id=pad_id, seed=0)
        with steps.get_lock():
            steps.value += 4


def serve_once(target, tokenizer, prototype, prompts, args) -> float:
    capacity = max(len(p) for p in prompts) + args.max_new_tokens
    make = lockstep_factory(prototype, 2 * args.concurrency + 2, capacity + 64, drafter_factory(prototype))
    engine = RecordingEngine(target, tokenizer, make, args.concurrency, capacity, len(prompts))
    config = GenerationConfig(args.max_new_tokens, args.num_draft_tokens, eos_token_ids=eos_token_ids(tokenizer))
    results, seconds = stream_all(engine, prompts, config, args.concurrency)
    return sum(len(tokens) for tokens, _ in results) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buffer", required=True)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default="smollm2-135m-instruct-drafter")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    target, tokenizer = load_target(args.target, torch.float32)
    options = parse_options(["prompt_lookup=0", "prompt_lookup_alone=0", "confidence_threshold=0"])
    prototype = load_drafter(target, tokenizer, args.draft, options=options)
    prompts = [tokenizer(text)["input_ids"] for text in code_prompts(args.prompts, 14, seed=1)]
    train, _ = ReplayBuffer(args.buffer, 10**6, 5).records()
    model = hf_from_native(prototype.model)
    state = {"config": model.config.to_dict(), "weights": {k: v for k, v in model.state_dict().items()}}
    keep, pad_id = prototype.vocab_keep, tokenizer.eos_token_id
    settings = ["none", "thread nice 0", "thread nice 19", "process nice 0", "process nice 19"]
    speeds: dict[str, list[float]] = {name: [] for name in settings}
    rates: dict[str, list[float]] = {name: [] for name in settings}
    context = multiprocessing.get_context("spawn")
    for _ in range(args.repeats):
        for name in settings:
            worker, stop, steps = None, None, context.Value("i", 0)
            if name != "none":
                kind, nice = name.split()[0], int(name.split()[-1])
                if kind == "thread":
                    stop = threading.Event()
                    worker = threading.Thread(target=train_forever,
                                              args=(state, train, keep, pad_id, nice, stop, steps))
                else:
                    stop = context.Event()
                    worker = context.Process(target=train_forever, args=(state, train, keep, pad_id, nice, stop, steps))
                worker.start()
                time.sleep(5)  # let it reach its training loop
            started, before = time.perf_counter(), steps.value
            speeds[name].append(serve_once(target, tokenizer, prototype, prompts, args))
            rates[name].append((steps.value - before) / (time.perf_counter() - started))
            if worker is not None:
                stop.set()
                worker.join()
            print(f"{name}: {speeds[name][-1]:.2f} tokens/s, {rates[name][-1]:.2f} training steps/s", flush=True)
    print("trainer | serving tokens/s (median) | training steps/s while serving (median)")
    for name in settings:
        print(f"{name} | {statistics.median(speeds[name]):.2f} | {statistics.median(rates[name]):.2f}")


if __name__ == "__main__":
    main()
