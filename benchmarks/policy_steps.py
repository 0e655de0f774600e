"""Where a speculation policy spends its steps: per draft kind (what the drafter said it would draft before drafting)
and draft size, how many steps, the mean accepted tokens, the mean wall time of the whole step and of its drafting,
and what the adaptive policy learned (per-depth acceptance, the catch-up and drafting lines, the verify scale and
slope). It shows a policy that prices drafting wrong: a kind it never drafts although fixed drafts of it pay. A draft
model's step that read its sequence's prompt (tens of ms: prefill, which the policy does not price as drafting) is
counted apart, as (kind, "prompt read"), so that it does not inflate its kind's means.

    python benchmarks/policy_steps.py                          # the shipped drafter, adaptive, the demo's prompts
    python benchmarks/policy_steps.py --speculation fixed --num-draft-tokens 2 --drafter prompt-lookup
    python benchmarks/policy_steps.py --questions ../shared/data/spec_bench/question.jsonl --per-category 2

The target is the built-in SmolLM2 on its GGUF blocks; every method answers greedily, so the answers do not depend
on the policy (only the timings do).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import torch

import specdraft.sequence as sequence
from specdraft.api import eos_token_ids, load_target
from specdraft.decoding import generate
from specdraft.demo import _one_per_category
from specdraft.drafters import load_drafter
from specdraft.drafters.base import catch_up, draft_kind
from specdraft.models.registry import SMOLLM2, SMOLLM2_DRAFTER
from specdraft.prompts import encode_prompt
from specdraft.sequence import GenerationConfig, speculation_policy
from specdraft.speculation import depth_key


def _prompts(args) -> list[str]:
    if args.questions is None:
        return [prompt.text for prompt in _one_per_category()[:4]]
    by_category: dict[str, list[str]] = collections.defaultdict(list)
    with open(args.questions) as lines:
        for line in lines:
            question = json.loads(line)
            by_category[question["category"]].append(question["turns"][0])
    return [text for texts in by_category.values() for text in texts[: args.per_category]]


def _line(line, per: str) -> str:
    slope = "?" if line.slope is None else f"{1e3 * line.slope:.2f}"
    return f"{1e3 * line.intercept:.2f} ms + {slope} ms a further {per}"


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default=f"draft:{SMOLLM2_DRAFTER}", help="draft:NAME or a named drafter")
    parser.add_argument("--speculation", default="adaptive", choices=("adaptive", "fixed"))
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--questions", help="Spec-Bench question.jsonl (default: the demo's four prompts)")
    parser.add_argument("--per-category", type=int, default=2)
    args = parser.parse_args()

    target, tokenizer = load_target(SMOLLM2, quantize="gguf")
    if args.drafter.startswith("draft:"):
        drafter = load_drafter(target, tokenizer, draft=args.drafter.removeprefix("draft:"))
    else:
        drafter = load_drafter(target, tokenizer, drafter=args.drafter)
    config = GenerationConfig(args.max_new_tokens, args.num_draft_tokens, eos_token_ids=eos_token_ids(tokenizer),
                              speculation=args.speculation)
    policy = speculation_policy(config, target, drafter)
    step: dict = {}
    propose = sequence.propose

    def traced_propose(policy_, drafter_, context, cached, bounds, sampling, generator):
        step["kind"], step["started"] = draft_kind(drafter_, context, sampling), time.perf_counter()
        return propose(policy_, drafter_, context, cached, bounds, sampling, generator)

    seen: dict[tuple, list[tuple[int, float, float]]] = collections.defaultdict(list)
    observe = policy.observe

    def traced_observe(draft, result, draft_seconds, verify_seconds):
        wall = time.perf_counter() - step["started"]
        record = catch_up(drafter, step["started"])  # a draft model's forward in this step that read its prompt
        kind = (step["kind"], "prompt read") if record is not None and record.fresh else step["kind"]
        seen[(kind, len(draft))].append((len(result.accepted_nodes), wall, draft_seconds))
        return observe(draft, result, draft_seconds, verify_seconds)

    sequence.propose, policy.observe = traced_propose, traced_observe
    generate(target, encode_prompt(tokenizer, "Hi", chat=True), None, GenerationConfig(8))  # warm-up
    for text in _prompts(args):
        generate(target, encode_prompt(tokenizer, text, chat=True), drafter, config, torch.Generator().manual_seed(0),
                 policy=policy)
    sequence.propose = propose

    tokens = sum(1 + accepted for rows in seen.values() for accepted, _, _ in rows)
    seconds = sum(wall for rows in seen.values() for _, wall, _ in rows)
    print(f"{args.drafter}, {args.speculation}: {tokens} tokens in {seconds:.2f} s of steps ({tokens / seconds:.1f} "
          "tokens/s, prefill excluded)")
    print(f"{'kind':24s} {'verified':>8s} {'steps':>6s} {'accepted':>9s} {'step ms':>8s} {'draft ms':>9s}")
    for (kind, size), rows in sorted(seen.items(), key=lambda item: (str(item[0][0]), item[0][1])):
        print(f"{kind!s:24s} {size:8d} {len(rows):6d} {statistics.mean(r[0] for r in rows):9.2f} "
              f"{1e3 * statistics.mean(r[1] for r in rows):8.2f} {1e3 * statistics.mean(r[2] for r in rows):9.2f}")
    if hasattr(policy, "kinds"):
        for kind, state in policy.kinds.items():
            rates = [round(policy.acceptance.rate(depth_key(depth, kind)), 2) for depth in range(1, 5)]
            print(f"{kind!s}: acceptance by depth {rates}, catch-up {_line(state.catch_up, 'token read')}, "
                  f"drafting {_line(state.drafting, 'token drafted')}")
        print(f"verify scale {policy.verify_scale:.3f}, slope {policy.verify_slope:.3f}")


if __name__ == "__main__":
    main()
