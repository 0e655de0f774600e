"""The benchmark runner: answer every selected question with every method, interleaved, one record per answer.

Order: for each question, each repeat, every method in turn, the order rotated by one each time (so no method
always runs first, right after another's cache warmed up). Each method answers one short warm-up generation first.
Each answer gets a fresh ``torch.Generator`` seeded with ``config.seed`` and carried across its turns, so repeats
are pure timing repeats. Records are appended as they are made; a rerun of the same command resumes where the last
one stopped. The report is computed afterwards from the records alone (:mod:`specdraft.bench.report`).
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from specdraft.bench.config import BenchConfig
from specdraft.bench.methods import BuildContext, Method, build_methods
from specdraft.bench.questions import GENERATED_SOURCES, Question, conversation_ids, load_questions, select_questions
from specdraft.bench.records import (
    ANSWERS_DIR,
    append_record,
    check_out,
    file_sha256,
    load_answers,
    make_record,
    method_filename,
    prepare_out,
    record_key,
)
from specdraft.bench.report import write_report
from specdraft.costs import cost_curve
from specdraft.decoding import PrefixCache
from specdraft.hardware import cpu_model
from specdraft.models.quantized_llama import KV_CACHE_ENV
from specdraft.models.registry import choose_precision, eos_token_ids, load_target
from specdraft.sequence import GenerationConfig

WARMUP_TOKENS = 8


def environment() -> dict:
    """Versions and hardware of this process (recorded in run.json, reported in summary.json's setup)."""
    import transformers

    import specdraft

    return {
        "versions": {"specdraft": specdraft.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
        "hardware": {"cpu": cpu_model(), "isa": torch.backends.cpu.get_cpu_capability(),
                     "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
                     "platform": platform.platform(), "cuda": torch.cuda.is_available()},
    }


def rotated(items: Sequence, shift: int) -> list:
    """``items`` from index ``shift`` (modulo their number) round to the start: the order a round of interleaved
    methods runs in, rotated from one round to the next so a shared machine's drift falls on all of them alike."""
    shift %= len(items)
    return [*items[shift:], *items[:shift]]


def schedule(questions: Sequence[Question], methods: Sequence[Method], repeats: int,
             done: set[tuple]) -> list[tuple[Question, Method, int]]:
    """(question, method, repeat) still to answer, interleaved with the method order rotated every round."""
    todo = []
    for i, question in enumerate(questions):
        for repeat in range(repeats):
            for method in rotated(methods, i * repeats + repeat):
                if (question.question_id, method.name, repeat) not in done:
                    todo.append((question, method, repeat))
    return todo


def answer_question(question: Question, method: Method, repeat: int, tokenizer, config: GenerationConfig,
                    seed: int) -> dict:
    """Answer every turn of ``question`` (each turn sees the conversation so far, with the method's own earlier
    answers as assistant turns) and return the record."""
    generator = torch.Generator().manual_seed(seed)
    results, texts = [], []
    for _ in question.turns:
        ids = conversation_ids(tokenizer, question.turns, texts)
        result = method.answer(ids, config, generator)
        results.append(result)
        texts.append(tokenizer.decode(result.token_ids, skip_special_tokens=True).strip())
    return make_record(question, method, repeat, results, texts)


def warm_up(methods: Sequence[Method], tokenizer, question: Question, config: GenerationConfig) -> None:
    """One short generation per method (first-call allocations and kernel selection stay out of the timings); a
    specdraft method's prefix cache is emptied after it, so the first question is not read from its warm-up."""
    short = replace(config, max_new_tokens=min(WARMUP_TOKENS, config.max_new_tokens))
    ids = conversation_ids(tokenizer, question.turns, [])
    for method in methods:
        method.answer(ids, short, torch.Generator().manual_seed(0))
        if getattr(method, "prefix_cache", None) is not None:
            method.prefix_cache = PrefixCache()


def _run_info(config: BenchConfig, questions_sha256: str | None, command: Sequence[str] | None) -> dict:
    identity = config.identity()
    if os.environ.get(KV_CACHE_ENV):  # a quantized target's KV cache format, when chosen (--kv-cache)
        identity["kv_cache"] = os.environ[KV_CACHE_ENV]
    return {"command": list(command) if command is not None else None, "config": identity,
            "questions_sha256": questions_sha256, "environment": environment(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def run_bench(config: BenchConfig, command: Sequence[str] | None = None, overwrite: bool = False,
              progress: bool = True, plots: bool = True) -> dict:
    """Run (or resume) the benchmark described by ``config`` and write its report; return summary.json's dict.

    ``command`` is recorded in run.json. A folder holding a run with another config is an error unless
    ``overwrite`` (which discards its answers).
    """
    from tqdm import tqdm

    out = Path(config.out)
    questions = select_questions(load_questions(config.questions), config.categories, config.per_category)
    sha = None if config.questions in GENERATED_SOURCES else file_sha256(config.questions)
    run_info = _run_info(config, sha, command)
    check_out(out, run_info, overwrite)
    quantize = "none" if config.device != "cpu" and config.quantize == "auto" else config.quantize  # blocks: CPU
    precision = choose_precision(config.target, config.dtype, quantize, torch.bfloat16)
    target, tokenizer = load_target(config.target, precision.dtype, quantize=precision.quantize, device=config.device)
    kv = getattr(target, "kv_dtype", None)
    run_info["precision"] = precision.describe() + ("" if kv is None else f", KV cache {str(kv)[6:]}")
    ctx = BuildContext(target, tokenizer, config.target, precision.draft_dtype, speculations=config.speculation,
                       device=config.device, prefix_cache=config.prefix_cache)
    methods = build_methods(ctx, config.methods, config.gammas, config.sweep is not None)
    run_info["cost_curve"] = cost_curve(target, log=lambda line: print(line, file=sys.stderr, flush=True)).to_dict()
    gen = GenerationConfig(config.max_new_tokens, config.num_draft_tokens, config.sampling,
                           eos_token_ids(tokenizer, config.target))
    run_info["method_names"] = [m.name for m in methods]
    prepare_out(out, run_info, overwrite)
    done = {record_key(r) for r in load_answers(out, repair=True)}
    todo = schedule(questions, methods, config.repeats, done)
    if todo:
        warm_up(methods, tokenizer, questions[0], gen)
    bar = tqdm(todo, desc="bench", unit="answer", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    for question, method, repeat in bar:
        bar.set_postfix_str(f"{method.name} q={question.question_id}", refresh=False)
        record = answer_question(question, method, repeat, tokenizer, gen, config.seed)
        append_record(out / ANSWERS_DIR / method_filename(method.name), record)
    return write_report(out, plots=plots)
