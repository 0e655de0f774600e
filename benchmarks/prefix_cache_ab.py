"""What the prefix cache saves plain decoding: Spec-Bench questions (every turn) answered with and without a
:class:`~specdraft.decoding.PrefixCache`, alternating question by question (the order swapped every other one), and
the prefill and wall seconds of each, summed. The answers are compared too (they must be equal).

    python benchmarks/prefix_cache_ab.py --questions ../shared/data/spec_bench/question.jsonl --per-category 4

The target is the built-in SmolLM2 on its GGUF blocks.
"""

from __future__ import annotations

import argparse
import time

import torch

from specdraft.api import eos_token_ids, load_target
from specdraft.bench.questions import conversation_ids, load_questions, select_questions
from specdraft.decoding import PrefixCache, generate
from specdraft.models.registry import SMOLLM2
from specdraft.sequence import GenerationConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", required=True, help="a Spec-Bench question.jsonl")
    parser.add_argument("--per-category", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    target, tokenizer = load_target(SMOLLM2, quantize="gguf")
    questions = select_questions(load_questions(args.questions), per_category=args.per_category)
    config = GenerationConfig(args.max_new_tokens, eos_token_ids=eos_token_ids(tokenizer))
    generate(target, conversation_ids(tokenizer, questions[0].turns, []), None, GenerationConfig(8))  # warm-up
    kept = PrefixCache()
    seconds = {True: [0.0, 0.0], False: [0.0, 0.0]}  # prefix cache -> [prefill, wall]
    answers: dict[bool, list[list[int]]] = {True: [], False: []}
    for i, question in enumerate(questions):
        for use in (True, False) if i % 2 == 0 else (False, True):
            texts = []
            for _ in question.turns:
                ids = conversation_ids(tokenizer, question.turns, texts)
                start = time.perf_counter()
                result = generate(target, ids, None, config, prefix_cache=kept if use else None)
                seconds[use][1] += time.perf_counter() - start
                seconds[use][0] += result.stats.prefill_seconds
                answers[use].append(result.token_ids)
                texts.append(tokenizer.decode(result.token_ids, skip_special_tokens=True).strip())
    print(f"{len(questions)} questions, {len(answers[True])} answers, {torch.get_num_threads()} threads")
    for use in (False, True):
        prefill, wall = seconds[use]
        print(f"prefix cache {'on ' if use else 'off'}: prefill {prefill:.2f} s, wall {wall:.2f} s")
    print(f"answers equal: {answers[True] == answers[False]}")


if __name__ == "__main__":
    main()
