"""Greedy replay of drafters over a bench run's recorded ``ar`` answers: τ by subtask without running the target.

    .venv/bin/python benchmarks/replay_tau.py RUN_DIR --methods "draft:PATH;confidence_threshold=0.3,prompt-lookup" \
        [--num-draft-tokens 5]

RUN_DIR is a greedy ``specdraft bench`` run that holds ``answers/ar.jsonl``; its run.json gives the questions,
target, dtype, γ and max_new_tokens. Methods use bench's syntax; only drafters whose proposals depend on the context
alone can be replayed (draft models with their options, prompt-lookup, rest). Exact against a float32 run; against a
bfloat16 run the real τ differs a little where a wide verify rounds differently (see specdraft.bench.replay). Also
printed: the tree nodes verified per step, the width the target pays for.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from specdraft.bench.methods import BuildContext, build_methods
from specdraft.bench.questions import conversation_ids, load_questions
from specdraft.bench.records import read_run_info
from specdraft.bench.replay import replay
from specdraft.errors import SpecdraftError
from specdraft.models.registry import choose_precision, load_model, load_tokenizer


def replay_methods(run: Path, specs: list[str], num_draft_tokens: int | None = None,
                   on_method: Callable[[str, dict[str, float], float, float], None] | None = None) -> dict[str, dict]:
    """τ by subtask and overall ({spec: {subtask | "overall": τ}}) of each replayable method in ``specs``, replayed
    over the greedy run's ``ar`` answers; ``on_method(name, taus, nodes per step, seconds)`` after each method."""
    config = read_run_info(run)["config"]
    if config.get("temperature", 0.0) != 0.0:
        raise SpecdraftError("replay needs a greedy run")
    tokenizer = load_tokenizer(config["target"])
    quantize = config.get("quantize", "none")  # as the run chose its precision (bench: --dtype auto, its GGUF blocks)
    precision = choose_precision(config["target"], config["dtype"], quantize, torch.bfloat16)
    target = load_model(config["target"], precision.dtype, quantize=precision.quantize)
    questions = {q.question_id: q for q in load_questions(config["questions"])}
    answers = [json.loads(line) for line in (run / "answers" / "ar.jsonl").open(encoding="utf-8")]
    ctx = BuildContext(target, tokenizer, config["target"], precision.draft_dtype)
    gamma = num_draft_tokens or config["num_draft_tokens"]
    methods = [m for m in build_methods(ctx, specs, (gamma,), False) if m.drafter is not None]
    results = {}
    for method in methods:
        tokens, steps, nodes = defaultdict(int), defaultdict(int), [0]
        propose = method.drafter.propose

        def counted(*a, propose=propose, nodes=nodes):
            draft = propose(*a)
            nodes[0] += len(draft)
            return draft

        method.drafter.propose = counted
        started = time.perf_counter()
        for record in answers:
            question, choice = questions[record["question_id"]], record["choices"][0]
            for turn, answer in enumerate(choice["token_ids"]):
                prompt = conversation_ids(tokenizer, question.turns[: turn + 1], choice["turns"][:turn])
                lengths = replay(method.drafter, prompt, answer, method.num_draft_tokens, config["max_new_tokens"],
                                 target)
                for key in (record["subtask"], "overall"):
                    tokens[key] += sum(lengths)
                    steps[key] += len(lengths)
        results[method.name] = {key: tokens[key] / steps[key] for key in tokens}
        if on_method is not None:
            on_method(method.name, results[method.name], nodes[0] / steps["overall"], time.perf_counter() - started)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--methods", required=True, help="comma-separated, as for specdraft bench")
    parser.add_argument("--num-draft-tokens", type=int, help="γ (default: the run's)")
    args = parser.parse_args()
    answers = [json.loads(line) for line in (args.run / "answers" / "ar.jsonl").open(encoding="utf-8")]
    subtasks = sorted({a["subtask"] for a in answers})
    print(f"| method | {' | '.join(subtasks)} | overall | nodes/step | seconds |")

    def show(name: str, taus: dict[str, float], nodes: float, seconds: float) -> None:
        cells = " | ".join(f"{taus[k]:.2f}" for k in [*subtasks, "overall"])
        print(f"| {name} | {cells} | {nodes:.1f} | {seconds:.0f} |", flush=True)

    replay_methods(args.run, args.methods.split(","), args.num_draft_tokens, show)


if __name__ == "__main__":
    main()
