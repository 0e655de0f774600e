"""``specdraft demo``: the real target answering built-in chat prompts with plain decoding and each drafter."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdraft.decoding import GenerationConfig, GenerationResult, generate
from specdraft.drafters import TRAINING_FREE
from specdraft.drafters.loading import load_drafter
from specdraft.errors import SpecdraftError
from specdraft.models.registry import DEFAULT_DRAFTERS, SHIPPED, SMOLLM2, eos_token_ids, load_target
from specdraft.prompts import BUILTIN_PROMPTS, encode_prompt

# layer-skip is left out by default: its first use calibrates for minutes, and on this small target it drafts slower
# than plain decoding; medusa and eagle need trained heads (--drafter-option heads=PATH in generate)
DEMO_DRAFTERS = ("prompt-lookup", "rest", "lookahead")


@dataclass(frozen=True)
class DemoConfig:
    target: str = SMOLLM2
    draft: str | None = None
    num_prompts: int = 4
    max_new_tokens: int = 96
    num_draft_tokens: int = 4
    dtype: torch.dtype = torch.float32
    drafters: tuple[str, ...] = DEMO_DRAFTERS  # training-free drafters shown beside the draft model


def run_demo(config: DemoConfig, out=print) -> list[dict]:
    """Answer the prompts with each method and print the answers and a summary table; return the table rows."""
    target, tokenizer = load_target(config.target, config.dtype)
    methods = {"plain": None}
    draft = config.draft or DEFAULT_DRAFTERS.get(config.target)
    if draft and (config.draft or (SHIPPED[draft] / "config.json").is_file()):
        methods[f"draft:{draft}"] = load_drafter(target, tokenizer, draft=draft, dtype=config.dtype)
    for name in config.drafters:
        if name not in TRAINING_FREE:
            raise SpecdraftError(f"unknown drafter {name!r}; known: {', '.join(sorted(TRAINING_FREE))}")
        try:
            methods[name] = load_drafter(target, tokenizer, drafter=name)
        except SpecdraftError as exc:  # e.g. rest without a datastore: say why and go on
            out(f"skipping {name}: {exc}")
    gen = GenerationConfig(config.max_new_tokens, config.num_draft_tokens, eos_token_ids=eos_token_ids(tokenizer))
    prompts = [p for p in _one_per_category()][: config.num_prompts]
    ids = [encode_prompt(tokenizer, p.text, chat=True) for p in prompts]
    generate(target, ids[0], None, GenerationConfig(8))  # warm-up
    results: dict[str, list[GenerationResult]] = {}
    for name, drafter in methods.items():
        results[name] = [generate(target, x, drafter, gen, torch.Generator().manual_seed(0)) for x in ids]
    for prompt, *answers in zip(prompts, *results.values(), strict=True):
        out(f"\n## [{prompt.category}] {prompt.text[:100]}{'...' if len(prompt.text) > 100 else ''}")
        out(tokenizer.decode(answers[0].token_ids, skip_special_tokens=True).strip())
    rows = [_row(name, rs, results["plain"]) for name, rs in results.items()]
    out(f"\n{config.target}, {str(config.dtype).removeprefix('torch.')}, greedy, num_draft_tokens "
        f"{config.num_draft_tokens}, {len(ids)} prompts x {config.max_new_tokens} new tokens max")
    width = max(28, *(len(row["method"]) + 2 for row in rows))
    out(f"{'method':<{width}}{'tokens/s':>10}{'block eff.':>12}{'speed-up':>10}{'identical to plain':>20}")
    for row in rows:
        out(f"{row['method']:<{width}}{row['tokens_per_second']:>10.1f}{row['block_efficiency']:>12.2f}"
            f"{row['speedup']:>9.2f}x{row['identical']:>20}")
    if config.dtype != torch.float32:
        out("note: in bf16 a k-token verify and a 1-token step round differently, so greedy outputs may differ from "
            "plain decoding where logits nearly tie; --dtype float32 gives token-identical outputs.")
    return rows


def _one_per_category():
    seen, first, rest = set(), [], []
    for p in BUILTIN_PROMPTS:
        (rest if p.category in seen else first).append(p)
        seen.add(p.category)
    return first + rest


def _row(name: str, results: list[GenerationResult], plain: list[GenerationResult]) -> dict:
    tokens = sum(r.stats.new_tokens for r in results)
    seconds = sum(r.stats.decode_seconds for r in results)
    calls = sum(r.stats.target_forward_calls for r in results)
    base_tps = sum(r.stats.new_tokens for r in plain) / sum(r.stats.decode_seconds for r in plain)
    same = sum(r.token_ids == b.token_ids for r, b in zip(results, plain, strict=True))
    return {"method": name, "tokens_per_second": tokens / seconds, "block_efficiency": tokens / calls,
            "speedup": tokens / seconds / base_tps, "identical": f"{same}/{len(results)}"}
