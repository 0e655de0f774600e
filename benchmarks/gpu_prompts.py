"""The training prompts of the GPU recipe (``benchmarks/gpu_recipe.py``): a shuffled pool of Spec-Bench-shaped
task prompts built from the ShareGPT train split (``sharegpt-tasks``), ``specdraft task-prompts`` (translation,
summaries, questions, word problems, passages), ShareGPT first turns and later turns in their context; one
``{"prompt"}`` or ``{"messages"}`` a line, gzipped (``distill-data --prompts`` reads ``.jsonl.gz``). No Spec-Bench
question is used (they are the held-out set).

    python benchmarks/gpu_prompts.py --out prompts.jsonl.gz \
        [--tasks 8000 --per-task 1000 --first-turns 6000 --turns 2000]
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from collections import Counter

from specdraft.corpus import sharegpt_prompts
from specdraft.training.data.prompt_sources import load_prompt_sources
from specdraft.training.data.task_prompts import build_task_prompts


def pool(tasks: int, per_task: int, first_turns: int, turns: int, max_chars: int, seed: int) -> list[tuple[str, dict]]:
    """(kind, record) pairs: distinct prompts of at most ``max_chars`` characters, shuffled."""
    records: list[tuple[str, dict]] = []
    for prompt_id, messages in load_prompt_sources("sharegpt-tasks", "train", tasks):
        records.append((f"sharegpt-tasks:{prompt_id.split(':')[1]}", {"messages": messages}))
    for prompt in build_task_prompts(per_task, seed):
        records.append((f"task-prompts:{prompt.category}", {"prompt": prompt.prompt}))
    for record in sharegpt_prompts(split="train", limit=first_turns):
        records.append(("sharegpt:first-turn", {"messages": record.messages()}))
    for _, messages in load_prompt_sources("sharegpt-turns", "train", turns):
        records.append(("sharegpt-turns", {"messages": messages}))
    seen, kept = set(), []
    for kind, record in records:
        text = json.dumps(record, sort_keys=True)
        if text not in seen and len(text) <= max_chars:
            seen.add(text)
            kept.append((kind, record))
    random.Random(seed).shuffle(kept)
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="a .jsonl.gz (or .jsonl) to write")
    parser.add_argument("--tasks", type=int, default=8000, help="sharegpt-tasks prompts (kinds in turn)")
    parser.add_argument("--per-task", type=int, default=1000, help="task-prompts per task")
    parser.add_argument("--first-turns", type=int, default=6000, help="ShareGPT first turns")
    parser.add_argument("--turns", type=int, default=2000, help="ShareGPT human turns with their context")
    parser.add_argument("--max-chars", type=int, default=6000, help="longest prompt record kept, in characters")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    kept = pool(args.tasks, args.per_task, args.first_turns, args.turns, args.max_chars, args.seed)
    text = "".join(json.dumps(record) + "\n" for _, record in kept)
    if args.out.endswith(".gz"):
        with gzip.open(args.out, "wt", encoding="utf-8") as file:
            file.write(text)
    else:
        with open(args.out, "w", encoding="utf-8") as file:
            file.write(text)
    print(json.dumps({"prompts": len(kept), "kinds": dict(Counter(kind for kind, _ in kept)), "out": args.out}))


if __name__ == "__main__":
    main()
