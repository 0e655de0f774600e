"""Where a decoding step's wall time goes, per function: each function of the loop named below is wrapped with a
timer (inclusive times, so nested ones overlap), and the methods answer the same prompts interleaved, prompt by
prompt. The C++ kernels (``fused_layers``, the LM head's ``linear``) against everything else shows the loop's own
cost: Python, torch's small ops, the policy's pricing and learning, the drafter's bookkeeping.

    python benchmarks/loop_split.py                      # plain, the shipped drafter, prompt lookup, n-gram
    python benchmarks/loop_split.py --prompts 8 --max-new-tokens 128

The target is the built-in SmolLM2 on its GGUF blocks; the prompts are Spec-Bench-like built-in ones, one a category
first. The timers add about a microsecond a call.
"""

from __future__ import annotations

import argparse
import collections
import functools
import time

import torch

import specdraft.decoding as decoding
import specdraft.drafters.combined as combined
import specdraft.drafters.draft_model as draft_model
import specdraft.drafters.ngram as ngram
import specdraft.models.native_llama as native_llama
import specdraft.models.quantized as quantized
import specdraft.sequence as sequence
import specdraft.speculation as speculation
import specdraft.step as step
from specdraft.api import eos_token_ids, load_target
from specdraft.demo import _one_per_category
from specdraft.drafters import load_drafter
from specdraft.models.registry import SMOLLM2, SMOLLM2_DRAFTER
from specdraft.prompts import encode_prompt
from specdraft.sequence import GenerationConfig

SECONDS: collections.Counter = collections.Counter()
CALLS: collections.Counter = collections.Counter()
WRAPPED = [  # (owner, attribute, label): the loop's parts, outermost first
    (decoding, "speculative_step", "speculative_step"), (sequence.SequenceState, "propose", "propose"),
    (sequence.SequenceState, "commit", "commit"), (step, "settle", "settle"), (step, "check_finite", "check_finite"),
    (step, "verify", "verify"), (native_llama.NativeLlama, "forward", "model forward"),
    (quantized, "fused_layers", "kernel: layers"), (quantized, "fused_layer", "kernel: prefill layers"),
    (quantized, "linear", "kernel: products (LM head)"),
    (speculation.AdaptivePolicy, "budget", "policy budget"), (speculation.AdaptivePolicy, "trim", "policy trim"),
    (speculation.AdaptivePolicy, "observe", "policy observe"),
    (draft_model.DraftModelDrafter, "chain", "draft model chain"),
    (combined.WithPromptLookup, "draft_kind", "draft kind (with prompt lookup)"),
    (combined.WithNGramTable, "draft_kind", "draft kind (with the n-gram table)"),
    (ngram.NGramDrafter, "propose", "n-gram propose"), (ngram.NGramDrafter, "draft_kind", "n-gram draft kind"),
]


def _timed(function, label: str):
    @functools.wraps(function)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            SECONDS[label] += time.perf_counter() - start
            CALLS[label] += 1
    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(SMOLLM2, quantize="gguf")
    for owner, name, label in WRAPPED:
        setattr(owner, name, _timed(getattr(owner, name), label))
    methods = {"plain": None, "draft model": load_drafter(target, tokenizer, draft=SMOLLM2_DRAFTER),
               "prompt lookup": load_drafter(target, tokenizer, drafter="prompt-lookup"),
               "n-gram": load_drafter(target, tokenizer, drafter="ngram")}
    prompts = [encode_prompt(tokenizer, prompt.text, chat=True) for prompt in _one_per_category()[: args.prompts]]
    config = GenerationConfig(args.max_new_tokens, eos_token_ids=eos_token_ids(tokenizer))
    for drafter in methods.values():  # warm-up: kernels built, caches sized
        decoding.generate(target, prompts[0], drafter, config)
    seconds = {name: collections.Counter() for name in methods}
    calls = {name: collections.Counter() for name in methods}
    wall = collections.Counter()
    for prompt in prompts:
        for name, drafter in methods.items():
            SECONDS.clear()
            CALLS.clear()
            start = time.perf_counter()
            decoding.generate(target, prompt, drafter, config)
            wall[name] += time.perf_counter() - start
            seconds[name].update(SECONDS)
            calls[name].update(CALLS)
    for name in methods:
        steps = calls[name]["speculative_step"]
        kernels = sum(seconds[name][label] for label in seconds[name] if label.startswith("kernel"))
        print(f"{name}: {wall[name]:.2f} s, {steps} steps, {1e3 * wall[name] / steps:.2f} ms a step "
              f"(prefill included), of which everything but the kernels {1e3 * (wall[name] - kernels) / steps:.2f}")
        for label in sorted(seconds[name], key=lambda label: -seconds[name][label]):
            print(f"  {label:34s} {1e3 * seconds[name][label] / steps:7.3f} ms a step ({calls[name][label]} calls)")


if __name__ == "__main__":
    main()
