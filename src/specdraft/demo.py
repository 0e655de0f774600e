"""``specdraft demo``: the real target answering built-in chat prompts with plain decoding and each drafter.

It runs on the fastest path of this CPU with adaptive speculation: the target's own GGUF blocks through the int8
kernels (:mod:`specdraft.models.quantized`) where they build, else the dense dtype fast here (:func:`fast_dtype`).
Every method answers every prompt in each of ``repeats`` rounds (fresh policies and prefix caches each round), and
the table gives each figure's median over the rounds: one pass over a few short answers moves 10% or more on a
shared machine. It says what it is doing as it goes and checks that each method's output is identical to plain
decoding: in the same run (every round) on the quantized path (its kernels are row-invariant, so identity holds bit
for bit) and in float32, else in a float32 pass of the same prompts (their first ``check_tokens`` tokens).
Below the table, one line per method that is not faster says why, from the measured costs of this machine.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

import specdraft.models.rowgemm as rowgemm
from specdraft import hardware
from specdraft.bench.runner import rotated
from specdraft.costs import CostCurve, cost_curve
from specdraft.decoding import PrefixCache, generate
from specdraft.drafters import NAMED_DRAFTERS
from specdraft.drafters.registry import load_drafter
from specdraft.errors import SpecdraftError
from specdraft.models.registry import (
    DEFAULT_DRAFTERS,
    SHIPPED,
    SMOLLM2,
    Precision,
    choose_precision,
    eos_token_ids,
    load_target,
)
from specdraft.prompts import BUILTIN_PROMPTS, encode_prompt
from specdraft.sequence import GenerationConfig, GenerationResult, speculation_policy
from specdraft.stats import add_counts, draft_lengths_line

# layer-skip is left out by default: its first use calibrates for minutes, and on this small target it drafts slower
# than plain decoding; medusa and eagle need trained heads (--drafter-option heads=PATH in generate)
DEMO_DRAFTERS = ("prompt-lookup", "ngram", "rest", "lookahead")


@dataclass(frozen=True)
class DemoConfig:
    target: str = SMOLLM2
    draft: str | None = None
    num_prompts: int = 4
    max_new_tokens: int = 96
    num_draft_tokens: int = 4
    dtype: torch.dtype | None = None  # None: the fastest path of this CPU (quantized blocks, else the fast dtype)
    quantize: str = "auto"  # target weights (registry.choose_precision)
    drafters: tuple[str, ...] = DEMO_DRAFTERS  # training-free drafters shown beside the draft model
    speculation: str = "adaptive"
    check_tokens: int = 32  # tokens per prompt of the float32 identity pass (when the fast dtype is not float32)
    repeats: int = 3  # rounds of every method over every prompt; the table gives each figure's median over them


def fast_dtype() -> tuple[torch.dtype, str]:
    """The dtype fast for decoding on this CPU, and why: bf16 where it is native (:func:`specdraft.hardware.fast_dtype`)
    and where the row kernel runs (:mod:`specdraft.models.rowgemm`, AVX2 CPUs): there a bf16 step reads half the
    bytes and a k-token bf16 verify costs about what an fp32 one does, so bf16 decodes faster at every draft length."""
    choice = hardware.fast_dtype()
    if not choice.bf16 and rowgemm.available():
        return torch.bfloat16, f"bfloat16: {choice.reason}, but the AVX2 row kernel multiplies it at fp32 speed"
    return (torch.bfloat16 if choice.bf16 else torch.float32), f"{choice.dtype}: {choice.reason}"


def _precision(config: DemoConfig) -> tuple[Precision, str]:
    """The run's precision and why: ``quantize`` auto takes a GGUF target's own blocks where the kernels run."""
    dense, why = (config.dtype, "as asked") if config.dtype is not None else fast_dtype()
    quantize = config.quantize
    if quantize == "auto" and config.dtype is None and not rowgemm.available():
        quantize = "none"  # no int8 kernels here: the fast dense dtype
    given = "auto" if config.dtype is None else str(config.dtype).removeprefix("torch.")
    precision = choose_precision(config.target, given, quantize, dense)
    if precision.quantize is not None:
        return precision, f"{precision.describe()}: the target's weights as published, int8 dot products"
    return precision, why


def _load_methods(config: DemoConfig, precision: Precision, out) -> tuple[object, object, dict]:
    out(f"loading {config.target} ({precision.describe()}) ...")
    target, tokenizer = load_target(config.target, precision.dtype, quantize=precision.quantize)
    dtype = precision.draft_dtype
    methods = {"plain": None}
    draft = config.draft or DEFAULT_DRAFTERS.get(config.target)
    if draft and (config.draft or (SHIPPED[draft] / "config.json").is_file()):
        out(f"loading draft model {draft} ...")
        methods[f"draft:{draft}"] = load_drafter(target, tokenizer, draft=draft, dtype=dtype)
    for name in config.drafters:
        if name not in NAMED_DRAFTERS:
            raise SpecdraftError(f"unknown drafter {name!r}; known: {', '.join(sorted(NAMED_DRAFTERS))}")
        try:
            out(f"loading {name} ...")
            methods[name] = load_drafter(target, tokenizer, drafter=name)
        except SpecdraftError as exc:  # e.g. rest without a datastore: say why and go on
            out(f"skipping {name}: {exc}")
    return target, tokenizer, methods


def _answer_all(target, methods: dict, ids: list, gen: GenerationConfig, out,
                label: str = "") -> dict[str, list[GenerationResult]]:
    """Every method answers every prompt, interleaved: each prompt by every method in turn, the order rotated from one
    prompt to the next, so that a shared machine's drift over the run falls on all methods alike (as ``bench``). A
    policy per method learns across its prompts; a prefix cache per method keeps the chat template's shared start."""
    policies = {name: speculation_policy(gen, target, drafter) for name, drafter in methods.items()}
    kept = {name: PrefixCache() for name in methods}  # each method's own: what its last prompt shares is read once
    results: dict[str, list[GenerationResult]] = {name: [] for name in methods}
    for i, x in enumerate(ids):
        for name in rotated(list(methods), i):
            results[name].append(generate(target, x, methods[name], gen, torch.Generator().manual_seed(0),
                                          policy=policies[name], prefix_cache=kept[name]))
            s = results[name][-1].stats
            out(f"  {label}{name}: prompt {i + 1}/{len(ids)}, {s.new_tokens} tokens at {s.tokens_per_second:.1f} "
                f"tokens/s, block efficiency {s.block_efficiency:.2f}")
    return results


def run_demo(config: DemoConfig, out=print) -> list[dict]:
    """Answer the prompts with each method and print the answers and a summary table; return the table rows."""
    precision, why = _precision(config)
    out(f"precision {why}")
    target, tokenizer, methods = _load_methods(config, precision, out)
    curve = cost_curve(target, log=out)
    gen = GenerationConfig(config.max_new_tokens, config.num_draft_tokens, eos_token_ids=eos_token_ids(tokenizer),
                           speculation=config.speculation)
    prompts = [p for p in _one_per_category()][: config.num_prompts]
    ids = [encode_prompt(tokenizer, p.text, chat=True) for p in prompts]
    out(f"warming up, then {config.repeats} x {len(methods)} methods x {len(ids)} prompts x up to "
        f"{config.max_new_tokens} tokens ...")
    generate(target, ids[0], None, GenerationConfig(8))  # warm-up
    rounds = [_answer_all(target, methods, ids, gen, out, f"round {r + 1}/{config.repeats}, " if config.repeats > 1
                          else "") for r in range(config.repeats)]  # each with fresh policies and prefix caches
    results = rounds[0]
    for prompt, *answers in zip(prompts, *results.values(), strict=True):
        out(f"\n## [{prompt.category}] {prompt.text[:100]}{'...' if len(prompt.text) > 100 else ''}")
        out(tokenizer.decode(answers[0].token_ids, skip_special_tokens=True).strip())
    identical, how = _identity(config, precision, ids, rounds, out)
    rows = [_median_row([_row(name, r[name], r["plain"], identical[name]) for r in rounds]) for name in results]
    out(f"\n{config.target}, {precision.describe()}, greedy, {config.speculation} speculation "
        f"(num_draft_tokens up to {config.num_draft_tokens}), {len(ids)} prompts x {config.max_new_tokens} new "
        f"tokens max, {_rounds(config.repeats)}; identical to plain: {how}")
    width = max(28, *(len(row["method"]) + 2 for row in rows))
    out(f"{'method':<{width}}{'tokens/s':>10}{'block eff.':>12}{'speed-up':>10}{'identical to plain':>20}")
    for row in rows:
        out(f"{row['method']:<{width}}{row['tokens_per_second']:>10.1f}{row['block_efficiency']:>12.2f}"
            f"{row['speedup']:>9.2f}x{row['identical']:>20}")
    for name, rs in results.items():
        if name != "plain":
            out(f"{name}: {_speculation_line(rs)}")
    for name, rs in results.items():
        if name != "plain" and rows[list(results).index(name)]["speedup"] < 1.0:
            out(why_not_faster(name, rs, results["plain"], curve))
    return rows


def _speculation_line(results: list[GenerationResult]) -> str:
    """Acceptance per draft position and the draft lengths the policy chose, over a method's answers."""
    accepted, reached, lengths = [], [], []
    for r in results:
        for total, counts in ((accepted, r.stats.accepted_per_position), (reached, r.stats.reached_per_position),
                              (lengths, r.stats.draft_length_counts)):
            add_counts(total, counts)
    acceptance = [a / n for a, n in zip(accepted, reached, strict=True) if n]
    return draft_lengths_line(acceptance, lengths) or "no drafts"


def _identity(config: DemoConfig, precision: Precision, ids: list, rounds: list[dict], out) -> tuple[dict, str]:
    """Per method "k/n" prompts whose greedy output equals plain decoding's (in every round), checked in this run
    (quantized blocks, float32) or in a float32 pass, and how."""
    results = rounds[0]
    if precision.quantize is not None or precision.dtype == torch.float32:
        how = f"{precision.quantize} blocks, this run" if precision.quantize is not None else "float32, this run"
        counts = {name: sum(all(r[name][i].token_ids == r["plain"][i].token_ids for r in rounds)
                            for i in range(len(ids))) for name in results}
        return {name: f"{counts[name]}/{len(ids)}" for name in results}, how
    out(f"checking identity in float32 (first {config.check_tokens} tokens of each answer) ...")
    fp32 = Precision(None, torch.float32, torch.float32)
    target, _, methods = _load_methods(config, fp32, lambda line: None)
    gen = GenerationConfig(config.check_tokens, config.num_draft_tokens, speculation=config.speculation)
    checked = _answer_all(target, {n: m for n, m in methods.items() if n in results}, ids, gen, out,
                          label="float32 check, ")
    how = f"float32 pass, first {config.check_tokens} tokens"
    plain = checked["plain"]
    counts = {name: sum(r.token_ids == b.token_ids for r, b in zip(rs, plain, strict=True))
              for name, rs in checked.items()}
    return {name: f"{counts.get(name, 0)}/{len(ids)}" for name in results}, how


def why_not_faster(name: str, results: list[GenerationResult], plain: list[GenerationResult],
                   curve: CostCurve) -> str:
    """One line: a method's speed-up is τ over what its step costs in plain steps (verify, drafting and the loop's
    own time), as measured in this run, with the machine's calibrated verify ratio beside it; the prompts' prefill,
    the same for every method, is priced apart (the table's tokens/s include it)."""
    calls = sum(r.stats.target_forward_calls for r in results)
    tau = sum(r.stats.new_tokens for r in results) / calls
    fed = 1 + sum(r.stats.draft_tokens_proposed for r in results) / calls  # tokens per verify forward
    plain_decode = sum(r.stats.decode_seconds - r.stats.prefill_seconds for r in plain)
    step = plain_decode / sum(r.stats.target_forward_calls for r in plain)  # a plain step, prefill apart
    verify = sum(r.stats.verify_seconds for r in results) / calls / step
    drafting = sum(r.stats.draft_seconds for r in results) / calls / step
    loop = sum(r.stats.overhead_seconds for r in results) / calls / step
    prefill = sum(r.stats.prefill_seconds for r in plain) / max(sum(r.stats.decode_seconds for r in plain), 1e-9)
    calibrated = curve.seconds(round(fed)) / curve.seconds(1)
    isa, dtype = curve.machine["isa"], curve.model["dtype"]
    return (f"{name} is not faster here: a step commits {tau:.2f} tokens (τ) but costs {verify + drafting + loop:.2f} "
            f"plain steps: verifying {fed:.1f} tokens {verify:.2f} (calibrated {calibrated:.2f}x a 1-token forward on "
            f"this {isa} CPU in {dtype}), drafting {drafting:.2f}, the loop {loop:.2f}; prefill is {prefill:.0%} of "
            f"plain decoding's time")


def _one_per_category():
    seen, first, rest = set(), [], []
    for p in BUILTIN_PROMPTS:
        (rest if p.category in seen else first).append(p)
        seen.add(p.category)
    return first + rest


def _rounds(repeats: int) -> str:
    return "one round" if repeats == 1 else f"medians of {repeats} rounds"


def _median_row(rows: list[dict]) -> dict:
    """A method's table row over the rounds: the median of each figure (tokens/s, τ, the speed-up against plain
    decoding in the same round)."""
    middle = {key: statistics.median(row[key] for row in rows)
              for key in ("tokens_per_second", "block_efficiency", "speedup")}
    return rows[0] | middle


def _row(name: str, results: list[GenerationResult], plain: list[GenerationResult], identical: str) -> dict:
    tokens = sum(r.stats.new_tokens for r in results)
    seconds = sum(r.stats.decode_seconds for r in results)
    calls = sum(r.stats.target_forward_calls for r in results)
    base_tps = sum(r.stats.new_tokens for r in plain) / sum(r.stats.decode_seconds for r in plain)
    return {"method": name, "tokens_per_second": tokens / seconds, "block_efficiency": tokens / calls,
            "speedup": tokens / seconds / base_tps, "identical": identical}

