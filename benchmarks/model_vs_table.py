"""Where the shipped drafter's model could beat its n-gram table: for every answer token of a `bench` run's plain
answers, the n-gram drafter's kind at that position (a context copy of n tokens, the table's order and share third,
or nothing), whether its first draft token is the target's next token, and whether the draft model's (teacher-forced:
one forward over the whole conversation) is.

    python benchmarks/model_vs_table.py OUT/answers/ar.jsonl --questions ../shared/data/spec_bench/question.jsonl

The target is the built-in SmolLM2 on its GGUF blocks; the drafter, its shipped one with the shipped table.
"""

from __future__ import annotations

import argparse
import collections
import json

import torch

from specdraft.api import load_target
from specdraft.bench.questions import conversation_ids, load_questions
from specdraft.drafters import load_drafter
from specdraft.drafters.draft_model import DraftModelDrafter
from specdraft.models.registry import SMOLLM2, SMOLLM2_DRAFTER
from specdraft.sampling import SamplingConfig


def kind_name(kind: int) -> tuple:
    """("copy", n), ("table", order, share third) or ("none",) for an n-gram drafter's kind."""
    if kind == 0:
        return ("none",)
    return ("copy", kind) if kind < 100 else ("table", kind // 10 - 10, kind % 10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("answers", help="a bench run's answers/ar.jsonl (token_ids of each turn)")
    parser.add_argument("--questions", required=True, help="the question.jsonl the run read")
    args = parser.parse_args()
    target, tokenizer = load_target(SMOLLM2, quantize="gguf")
    drafter = load_drafter(target, tokenizer, draft=SMOLLM2_DRAFTER)
    ngram, inner = drafter.ngram, drafter
    while not isinstance(inner, DraftModelDrafter):
        inner = inner.inner
    questions = {q.question_id: q for q in load_questions(args.questions)}
    greedy = SamplingConfig()
    counts = collections.defaultdict(lambda: [0, 0, 0])  # kind -> [positions, n-gram right, model right]
    with open(args.answers) as lines:
        for line in lines:
            record = json.loads(line)
            question, choice = questions[record["question_id"]], record["choices"][0]
            for turn, answer in enumerate(choice["token_ids"]):
                prompt = conversation_ids(tokenizer, question.turns, choice["turns"][:turn])
                ids = torch.tensor(prompt + answer)  # (N,)
                with torch.inference_mode():
                    logits = inner.model.forward(ids.unsqueeze(0), cache=inner.model.new_cache(ids.shape[0]))[0]
                guess = logits.argmax(-1)  # (N,) the model's next token after each position
                for p in range(len(prompt), ids.shape[0]):
                    context = ids[:p]
                    kind = ngram.draft_kind(context, greedy)
                    first = ngram.propose(context, 1, greedy, None)
                    row = counts[kind_name(kind)]
                    row[0] += 1
                    row[1] += int(len(first) > 0 and int(first.tokens[0]) == int(ids[p]))
                    row[2] += int(int(guess[p - 1]) == int(ids[p]))
    total = [0, 0, 0]
    print("| kind | positions | n-gram first token right | model first token right |\n|---|---|---|---|")
    for kind in sorted(counts, key=str):
        n, table, model = counts[kind]
        total = [a + b for a, b in zip(total, counts[kind], strict=True)]
        print(f"| {kind} | {n} | {table / n:.2f} | {model / n:.2f} |")
    print(f"| all | {total[0]} | {total[1] / total[0]:.2f} | {total[2] / total[0]:.2f} |")


if __name__ == "__main__":
    main()
