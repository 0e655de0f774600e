"""Distillation-data generation speed: answer tokens/s of each engine at each batch size, same prompts, same
settings, in one process (what ``distill-data`` spends per shard: chat template, generation, records).

Engines: ``native`` (specdraft's Llama: ragged rows on the CPU; on CUDA a static cache decoded by CUDA graphs,
:mod:`specdraft.models.static_batch`), ``static`` (that static batch on any device: eager on the CPU),
``native-refill`` / ``static-refill`` (the same with ``--refill``: all the prompts in one batch of the batch size's
rows, an ended row taking the next prompt) and ``hf`` (transformers' ``generate``, left-padded batches). The first
(warm-up) call answers two prompts; CUDA graph captures of the timed run count in its time, as in ``distill-data``.

    python benchmarks/bench_distill_data.py --target smollm2-135m-instruct --prompts sharegpt --limit 16 \
        --engines native,hf --batch-sizes 1,16 --max-new-tokens 64 --device cpu
    python benchmarks/bench_distill_data.py --target TARGET --prompts prompts.jsonl --limit 8192 --engines native \
        --batch-sizes 1024 --max-new-tokens 256 --device cuda --json-out bench.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch

from specdraft.hardware import cpu_model, resolve_device, resolve_dtype
from specdraft.models.registry import load_model, load_tokenizer, parse_dtype
from specdraft.training.data.distill_data import DistillDataConfig, generate_shard
from specdraft.training.data.native_generation import StaticEngine
from specdraft.training.data.prompt_sources import load_prompt_sources


def load_engine(engine: str, target: str, dtype: str, device: str):
    """The model object ``generate_shard`` takes for ``engine`` on ``device`` (``static``: the CUDA path's static
    batch on any device, eager on the CPU)."""
    native = engine != "hf"
    model = load_model(target, parse_dtype(dtype), backend="native" if native else "hf", device=device)
    if not native:
        return model.model
    static = device != "cpu" or engine.startswith("static")
    return StaticEngine(model, refill=engine.endswith("-refill")) if static else model


def measure(model, tokenizer, prompts: list, config: DistillDataConfig, profile: str | None = None,
            ledger: bool = False) -> tuple[dict, list[list[int]]]:
    """Answer ``prompts`` in batches of ``config.batch_size``: (tokens, seconds and rates; the answers). The static
    engine also reports ``row_step_use``: answer tokens written per row decoded (rows that ended but still run
    along, or that wait for the batch's longest answer, lower it). With ``profile`` (a path) the timed run is
    profiled (torch.profiler) and its top operators by device time and by host time are written there; with
    ``ledger``, the static engine's parts are counted and timed (:func:`engine_ledger`)."""
    generate_shard(model, tokenizer, prompts[:2], config, seed=1)  # warm-up: kernels, allocator
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    decoded_before = getattr(model, "row_steps", None)
    parts: dict = {}
    with profiled(profile), engine_ledger(parts if ledger and decoded_before is not None else None):
        start = time.perf_counter()
        records = generate_shard(model, tokenizer, prompts, config, seed=0)
        seconds = time.perf_counter() - start
    tokens = sum(len(r["response_token_ids"]) for r in records)
    row = {"prompts": len(prompts), "answer_tokens": tokens, "seconds": round(seconds, 2),
           "answer_tokens_per_s": round(tokens / seconds, 1), "prompts_per_min": round(60 * len(prompts) / seconds, 1),
           "eos_share": round(sum(r["finish_reason"] == "eos" for r in records) / len(records), 3),
           "profiled": profile is not None}
    if decoded_before is not None:  # each answer's first token comes from the prefill
        row["row_step_use"] = round((tokens - len(records)) / max(model.row_steps - decoded_before, 1), 3)
    if parts:
        rest = seconds - parts["prefill_s"] - parts["capture_s"] - parts["compaction_s"]
        row["ledger"] = {k: round(v, 3) if isinstance(v, float) else v for k, v in parts.items()} | {
            "other_s": round(rest, 3), "other_ms_per_step": round(1000 * rest / max(parts["steps"], 1), 3),
            "mean_rows_per_step": round(parts["rows_decoded"] / max(parts["steps"], 1), 1),
            "mean_slots_per_row": round(parts["slots_attended"] / max(parts["rows_decoded"], 1), 1)}
    return row, [r["response_token_ids"] for r in records]


@contextlib.contextmanager
def engine_ledger(parts: dict | None):
    """While the block runs, count and time the parts of the static engine (:class:`StaticBatch`) into ``parts``:
    prefill calls, prompts, tokens and seconds, CUDA graph captures and seconds, compactions and seconds (each
    synchronised at both ends: they happen at checks, where the loop reads the device anyway), and decode steps,
    rows decoded and cache slots attended (counted only: no synchronisation per step). The time left over is the
    decode steps' and the host's (``other_s`` in the row)."""
    if parts is None:
        yield
        return
    from specdraft.models.static_batch import END_STEP, StaticBatch

    parts |= {"prefill_calls": 0, "prefill_prompts": 0, "prefill_tokens": 0, "prefill_s": 0.0, "graphs_captured": 0,
              "capture_s": 0.0, "compactions": 0, "compaction_s": 0.0, "steps": 0, "rows_decoded": 0,
              "slots_attended": 0}
    originals = {name: getattr(StaticBatch, name) for name in ("prefill", "_capture", "keep_rows", "decode")}

    def timed(name: str, calls: str, seconds: str, count=None):
        def wrapper(self, *args, **kwargs):
            _synchronize(self.device)
            started = time.perf_counter()
            result = originals[name](self, *args, **kwargs)
            _synchronize(self.device)
            parts[seconds] += time.perf_counter() - started
            parts[calls] += 1
            if count is not None:
                count(*args)
            return result
        return wrapper

    def prefilled(prompts, rows=None):
        parts["prefill_prompts"] += len(prompts)
        parts["prefill_tokens"] += sum(map(len, prompts))

    def decode(self, tokens, n, end):
        parts["steps"], parts["rows_decoded"] = parts["steps"] + 1, parts["rows_decoded"] + n
        parts["slots_attended"] += n * min(self.capacity, -(-end // END_STEP) * END_STEP)
        return originals["decode"](self, tokens, n, end)

    replacements = {"prefill": timed("prefill", "prefill_calls", "prefill_s", prefilled),
                    "_capture": timed("_capture", "graphs_captured", "capture_s"),
                    "keep_rows": timed("keep_rows", "compactions", "compaction_s"), "decode": decode}
    try:
        for name, function in replacements.items():
            setattr(StaticBatch, name, function)
        yield
    finally:
        for name, function in originals.items():
            setattr(StaticBatch, name, function)


def _synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def profiled(path: str | None):
    """torch.profiler around the block when ``path`` is given; its top 30 operators by device time (kernels) and by
    host time (launches, synchronisations, graph instantiation, allocations) written to ``path``."""
    if path is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        yield
    if cuda:
        torch.cuda.synchronize()
    averages = prof.key_averages()
    tables = [f"top operators by {name}\n" + averages.table(sort_by=key, row_limit=30)
              for name, key in (("device time", "self_cuda_time_total"), ("host time", "self_cpu_time_total"))
              if cuda or key.startswith("self_cpu")]
    Path(path).write_text("\n\n".join(tables))
    print(tables[0], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", default="sharegpt", help="a distill-data prompt source (sharegpt, a jsonl, ...)")
    parser.add_argument("--limit", type=int, default=16, help="prompts answered")
    parser.add_argument("--engines", default="native,hf")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--top-logprobs", type=int, default=0, help="store the target's top-k per token too")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 where native), float32 or bfloat16")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--json-out", help="append one JSON line per (engine, batch size) here")
    parser.add_argument("--profile", help="profile the timed runs (torch.profiler): the top operators of each are "
                                          "written to PROFILE-<engine>-<batch size>.txt and printed")
    parser.add_argument("--ledger", action="store_true", help="count and time the static engine's parts: prefills, "
                                                             "graph captures, compactions, steps (the row's ledger)")
    parser.add_argument("--compare", action="store_true", help="also the share of answers identical to the first "
                                                               "engine's at the same batch size (greedy: in float32, "
                                                               "all of them)")
    args = parser.parse_args()
    device = resolve_device(args.device).name
    dtype = resolve_dtype(args.dtype, device).dtype
    tokenizer = load_tokenizer(args.target)
    prompts = load_prompt_sources(args.prompts, "train", args.limit)
    hardware = torch.cuda.get_device_name(device) if device != "cpu" else cpu_model()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    known = ("native", "static", "native-refill", "static-refill", "hf")
    if any(e not in known for e in engines):
        parser.error(f"--engines: each of {', '.join(known)}, got {args.engines!r}")
    first: dict[int, list[list[int]]] = {}  # batch size -> the first engine's answers
    for engine in engines:
        model = load_engine(engine, args.target, dtype, device)
        for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
            config = DistillDataConfig(target=args.target, out="-", max_new_tokens=args.max_new_tokens,
                                       temperature=0.0, batch_size=batch_size, shard_size=len(prompts), dtype=dtype,
                                       top_logprobs=args.top_logprobs, engine="hf" if engine == "hf" else "native",
                                       device=device, refill=engine.endswith("-refill"))
            where = f"{args.profile}-{engine}-{batch_size}.txt" if args.profile else None
            measured, answers = measure(model, tokenizer, prompts, config, where, args.ledger)
            row = {"engine": engine, "batch_size": batch_size, "device": device, "hardware": hardware,
                   "dtype": dtype, "max_new_tokens": args.max_new_tokens, "top_logprobs": args.top_logprobs,
                   "threads": torch.get_num_threads()} | measured
            if args.compare:
                reference = first.setdefault(batch_size, answers)
                row["same_answers_as_first_engine"] = sum(a == b for a, b in zip(answers, reference, strict=True))
            same = f", {row['same_answers_as_first_engine']} answers as the first engine's" if args.compare else ""
            print(f"{engine:>6} batch {batch_size:>5}: {row['answer_tokens_per_s']:>9.1f} answer tokens/s "
                  f"({row['answer_tokens']} tokens of {row['prompts']} answers in {row['seconds']:.1f} s, "
                  f"{row['prompts_per_min']:.0f} prompts/min{same}) on {hardware}", flush=True)
            print(json.dumps(row), flush=True)
            if args.json_out:
                with open(args.json_out, "a") as file:
                    file.write(json.dumps(row) + "\n")
        del model
        if device != "cpu":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
