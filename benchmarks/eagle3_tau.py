"""Block efficiency τ and first-draft-token acceptance of self-drafting heads on the built-in Spec-Bench-style prompts
(two per subtask, never trained on), bf16 or fp32, greedy, batch 1; methods interleaved prompt by prompt. A method is
``LABEL=DRAFTER@GAMMA:KEY=VALUE;KEY=VALUE`` (DRAFTER a training-free drafter name such as eagle or eagle3).
Usage: eagle3_tau.py 'eagle3-chain=eagle3@3:heads=DIR;top_k=1;tree_nodes=3' ... [--max-new-tokens 128]"""

import argparse
import json

import torch

from specdraft.decoding import GenerationConfig, generate
from specdraft.drafters import TRAINING_FREE, parse_options
from specdraft.models.registry import SMOLLM2, eos_token_ids, load_model, load_tokenizer
from specdraft.prompts import BUILTIN_PROMPTS, encode_prompt

parser = argparse.ArgumentParser()
parser.add_argument("methods", nargs="+")
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--dtype", default="bfloat16")
parser.add_argument("--every", type=int, default=1, help="every N-th built-in prompt (2: one per subtask)")
args = parser.parse_args()

target, tokenizer = load_model(SMOLLM2, getattr(torch, args.dtype)), load_tokenizer(SMOLLM2)
eos = eos_token_ids(tokenizer, SMOLLM2)
methods = []
for spec in args.methods:
    label, rest = spec.split("=", 1)
    head, _, options = rest.partition(":")
    name, gamma = head.split("@")
    methods.append((label, TRAINING_FREE[name](target, tokenizer, parse_options(options)), int(gamma)))
sums = {label: {"new": 0, "forwards": 0, "first": [0, 0], "accepted": 0, "drafted": 0} for label, _, _ in methods}
plain = {}
prompts = BUILTIN_PROMPTS[:: args.every]
for prompt in prompts:
    ids = encode_prompt(tokenizer, prompt.text, chat=True)
    reference = generate(target, ids, None, GenerationConfig(args.max_new_tokens, eos_token_ids=eos)).token_ids
    for label, drafter, gamma in methods:
        result = generate(target, ids, drafter, GenerationConfig(args.max_new_tokens, gamma, eos_token_ids=eos))
        stats, total = result.stats, sums[label]
        total["new"] += stats.new_tokens
        total["forwards"] += stats.target_forward_calls
        total["first"][0] += stats.accepted_per_position[0] if stats.accepted_per_position else 0
        total["first"][1] += stats.reached_per_position[0] if stats.reached_per_position else 0
        total["accepted"] += stats.draft_tokens_accepted
        total["drafted"] += stats.draft_tokens_proposed
        plain[label] = plain.get(label, 0) + int(result.token_ids == reference)
        print(f"{prompt.category:15s} {label:14s} τ {stats.block_efficiency:.2f}", flush=True)
for label, total in sums.items():
    row = {"method": label, "tau": round(total["new"] / max(total["forwards"], 1), 3),
           "first_token_acceptance": round(total["first"][0] / max(total["first"][1], 1), 3),
           "acceptance": round(total["accepted"] / max(total["drafted"], 1), 3),
           "equal_to_plain": f"{plain[label]}/{len(prompts)}", "dtype": args.dtype,
           "max_new_tokens": args.max_new_tokens}
    print(json.dumps(row), flush=True)
