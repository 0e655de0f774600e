"""Block efficiency τ, first-draft-token acceptance and wall time of self-drafting heads on Spec-Bench-style
questions (the built-in prompts, or a Spec-Bench ``question.jsonl``: the first turn of the first N questions of each
subtask), bf16 or fp32, greedy, batch 1, γ fixed unless --speculation adaptive; methods and plain decoding
interleaved question by question in one process.
A method is ``LABEL=DRAFTER@GAMMA:KEY=VALUE;KEY=VALUE`` (DRAFTER a training-free drafter such as eagle or eagle3;
eagle3 without heads= uses the heads shipped for SmolLM2). Prints one line per question and method, then one JSON
row per method (``tools/ship_eagle3.py --results`` turns those rows into a model card table).
Usage: eagle3_tau.py 'chain=eagle3@3:top_k=1' 'tree=eagle3@4:top_k=4;tree_nodes=16' \
    [--questions question.jsonl --per-category 2] [--max-new-tokens 128]"""

import argparse
import json
import os
import time
from pathlib import Path

import torch

from specdraft.bench.questions import BUILTIN, load_questions, select_questions
from specdraft.decoding import generate
from specdraft.drafters import NAMED_DRAFTERS, parse_options
from specdraft.hardware import cpu_bf16, cpu_capability, cpu_model
from specdraft.models.registry import SMOLLM2, eos_token_ids, load_model, load_tokenizer
from specdraft.prompts import encode_prompt
from specdraft.sequence import GenerationConfig

parser = argparse.ArgumentParser()
parser.add_argument("methods", nargs="+")
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--dtype", default="bfloat16")
parser.add_argument("--questions", default=BUILTIN, help="a Spec-Bench question.jsonl, or builtin")
parser.add_argument("--per-category", type=int, help="the first N questions of each Spec-Bench subtask")
parser.add_argument("--every", type=int, default=1, help="then every N-th question (builtin, 2: one per subtask)")
parser.add_argument("--speculation", choices=("fixed", "adaptive"), default="fixed",
                    help="fixed: γ draft tokens (tree depth) every step, the τ of that setting; adaptive: as generate")
args = parser.parse_args()

target, tokenizer = load_model(SMOLLM2, getattr(torch, args.dtype)), load_tokenizer(SMOLLM2)
eos = eos_token_ids(tokenizer, SMOLLM2)
methods = []
for spec in args.methods:
    label, rest = spec.split("=", 1)
    head, _, options = rest.partition(":")
    name, gamma = head.split("@")
    methods.append((label, name, options, NAMED_DRAFTERS[name](target, tokenizer, parse_options(options)), int(gamma)))
sums = {m[0]: {"new": 0, "forwards": 0, "first": [0, 0], "accepted": 0, "drafted": 0, "seconds": 0.0, "equal": 0}
        for m in methods}
questions = select_questions(load_questions(args.questions), per_category=args.per_category)[:: args.every]
load_before, plain_seconds = os.getloadavg()[0], 0.0
for question in questions:
    ids = encode_prompt(tokenizer, question.turns[0], chat=True)
    start = time.perf_counter()
    reference = generate(target, ids, None, GenerationConfig(args.max_new_tokens, eos_token_ids=eos)).token_ids
    plain_seconds += time.perf_counter() - start
    for label, _, _, drafter, gamma in methods:
        start = time.perf_counter()
        config = GenerationConfig(args.max_new_tokens, gamma, eos_token_ids=eos, speculation=args.speculation)
        result = generate(target, ids, drafter, config)
        stats, total = result.stats, sums[label]
        total["seconds"] += time.perf_counter() - start
        total["new"] += stats.new_tokens
        total["forwards"] += stats.target_forward_calls
        total["first"][0] += stats.accepted_per_position[0] if stats.accepted_per_position else 0
        total["first"][1] += stats.reached_per_position[0] if stats.reached_per_position else 0
        total["accepted"] += stats.draft_tokens_accepted
        total["drafted"] += stats.draft_tokens_proposed
        total["equal"] += int(result.token_ids == reference)
        print(f"{question.category:15s} {label:14s} τ {stats.block_efficiency:.2f}", flush=True)
setting = {"questions": Path(args.questions).name, "per_category": args.per_category, "prompts": len(questions),
           "dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "speculation": args.speculation,
           "cpu": cpu_model(), "cores": os.cpu_count(),
           "cpu_capability": cpu_capability(), "bf16_native": cpu_bf16()[0],
           "threads": torch.get_num_threads(), "load_avg": [round(load_before, 1), round(os.getloadavg()[0], 1)],
           "date": time.strftime("%Y-%m-%d", time.gmtime())}
for label, name, options, _, gamma in methods:
    total = sums[label]
    row = {"method": label, "drafter": name, "num_draft_tokens": gamma, "options": options,
           "tau": round(total["new"] / max(total["forwards"], 1), 3),
           "first_token_acceptance": round(total["first"][0] / max(total["first"][1], 1), 3),
           "acceptance": round(total["accepted"] / max(total["drafted"], 1), 3),
           "equal_to_plain": f"{total['equal']}/{len(questions)}",
           "speedup": round(plain_seconds / max(total["seconds"], 1e-9), 3)} | setting
    print(json.dumps(row), flush=True)
