"""vLLM as benchmarked methods (its offline engine, :mod:`specdraft.engines.vllm`):

- ``vllm``: vLLM's plain decoding of the target;
- ``vllm-ngram``: its n-gram prompt lookup (``method: ngram``; ``prompt_lookup_max`` 3 and ``prompt_lookup_min`` 1,
  the n-gram sizes of specdraft's ``prompt-lookup``; ``vllm-ngram:prompt_lookup_max=4;prompt_lookup_min=2`` changes
  them);
- ``vllm-draft:PATH``: an independent draft model (``method: draft_model``), e.g. ``specdraft export DRAFTER
  --format hf``;
- ``vllm-eagle3:PATH``: EAGLE-3 heads (``method: eagle3``), e.g. ``specdraft export HEADS --format eagle3``.

Each method (each γ of a sweep) runs one engine, started once when the methods are built and stopped at exit. vLLM
computes the target's dense checkpoint in the run's dense dtype (bf16 or float32; beside a GGUF-quantized ``ar`` row
it runs the dense weights in the dtype fast on this CPU), so compare it with an ``ar`` row given ``--dtype``. Every
answer gets the same prompt token ids as the other methods, greedy (or the run's sampling with a seed drawn from
the answer's generator), EOS as the stop token, no prefix caching (each answer pays its prefill). Per answer the
records keep vLLM's own counters: its per-request speculative-decoding metrics (accepted draft tokens of every
verify step, drafted tokens) give ``accept_lengths``, ``draft_tokens_proposed`` / ``draft_tokens_accepted`` and the
per-position counts, and the change of its Prometheus counters (``vllm:spec_decode_num_drafts``,
``..._num_draft_tokens``, ``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``) over the answer is kept
as ``engine_counters``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from specdraft.engines.vllm import EngineSettings, VllmEngine
from specdraft.errors import SpecdraftError

BENCH_KV_CACHE_GIB = 1.0  # one sequence at a time
SPEC_METHODS = {"vllm": None, "vllm-ngram": "ngram", "vllm-draft": "draft_model", "vllm-eagle3": "eagle3"}
NGRAM_DEFAULTS = {"prompt_lookup_max": 3, "prompt_lookup_min": 1}
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
COUNTER = "vllm:spec_decode_num_"


def speculative_config(kind: str, arg: str | None, num_draft_tokens: int | None) -> dict | None:
    """vLLM's ``speculative_config`` for a method kind (None for plain decoding)."""
    method = SPEC_METHODS[kind]
    if method is None:
        return None
    config = {"method": method, "num_speculative_tokens": num_draft_tokens}
    if method == "ngram":
        return config | NGRAM_DEFAULTS | _ngram_options(arg)
    return config | {"model": str(check_draft_folder(kind, arg))}


def _ngram_options(arg: str | None) -> dict:
    options = {}
    for item in filter(None, (arg or "").split(";")):
        key, _, value = item.partition("=")
        if key not in NGRAM_DEFAULTS or not value.strip().isdigit() or int(value) < 1:
            raise SpecdraftError(f"vllm-ngram takes prompt_lookup_max=N;prompt_lookup_min=N (N >= 1), got {item!r}")
        options[key] = int(value)
    return options


def check_draft_folder(kind: str, arg: str | None) -> Path:
    """The drafter folder of ``vllm-draft:PATH`` (a checkpoint) or ``vllm-eagle3:PATH`` (EAGLE-3 heads in the
    engines' layout), refused with the export command that makes it."""
    folder = Path(arg or "").expanduser()
    eagle3 = kind == "vllm-eagle3"
    make = f"specdraft export HEADS --format eagle3 --out {arg}" if eagle3 else \
        f"specdraft export DRAFTER --format hf --out {arg}"
    if not (folder / "config.json").is_file():
        raise SpecdraftError(f"{kind}: no checkpoint folder at {folder} (make one with `{make}`)")
    architectures = json.loads((folder / "config.json").read_text()).get("architectures") or []
    if eagle3 != any("Eagle3" in name for name in architectures):
        raise SpecdraftError(f"{kind}: {folder} holds {architectures or 'no architectures'}, not "
                             f"{'EAGLE-3 heads' if eagle3 else 'a draft model'} (make one with `{make}`)")
    return folder


def parameter_count(folder: str | Path) -> int:
    """Elements of the floating-point tensors in a folder's ``model.safetensors`` (read from its header)."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(Path(folder) / "model.safetensors"), "pt") as f:
        for name in f.keys():
            piece = f.get_slice(name)
            if piece.get_dtype() in ("F32", "BF16", "F16"):
                total += int(torch.Size(piece.get_shape()).numel())
    return total


def start_engine(target_folder: str, dtype: torch.dtype, kind: str, arg: str | None,
                 num_draft_tokens: int | None, seed: int = 0) -> VllmEngine:
    """One engine for a method (and γ); started now, stopped when closed or at exit."""
    spec = speculative_config(kind, arg, num_draft_tokens)
    settings = EngineSettings(model=target_folder, dtype=DTYPES.get(dtype, "float32"), speculative=spec,
                              max_num_seqs=4, seed=seed, kv_cache_gib=BENCH_KV_CACHE_GIB)
    return VllmEngine(settings)


def sampling_fields(max_new_tokens: int, eos_token_ids: Sequence[int], sampling, seed: int) -> dict:
    """``SamplingParams`` fields of one answer: the run's sampling, EOS as stop token, token ids only."""
    greedy = sampling.greedy
    return {"max_tokens": max_new_tokens, "stop_token_ids": [int(t) for t in eos_token_ids], "detokenize": False,
            "temperature": 0.0 if greedy else sampling.temperature, "top_p": 1.0 if greedy else sampling.top_p,
            "top_k": 0 if greedy else sampling.top_k, "seed": seed}


def _per_position(steps_accepted: list[int], steps_drafted: list[int]) -> tuple[list[int], list[int]]:
    """(accepted at position i, drafts that reached position i) from each verify step's accepted and drafted
    counts: a step reaches position i when it drafted more than i tokens and accepted the i before."""
    width = max(steps_drafted, default=0)
    accepted, reached = [0] * width, [0] * width
    for n_accepted, n_drafted in zip(steps_accepted, steps_drafted, strict=True):
        for i in range(min(n_drafted, n_accepted + 1)):
            reached[i] += 1
            accepted[i] += int(i < n_accepted)
    return accepted, reached


def engine_counters(counters: dict) -> dict | None:
    """vLLM's Prometheus speculative-decoding counters over one answer, under their short names (None: none)."""
    short = {name.removeprefix(COUNTER): value for name, value in counters.items() if name.startswith(COUNTER)}
    return short or None


def turn_result(answer: dict, wall: float, eos_token_ids: Sequence[int], drafting: bool, make: Callable):
    """A TurnResult from the worker's answer to one prompt: its tokens, prefill time and vLLM's counters.

    Target forwards (decoding_steps) are the tokens less the accepted draft tokens: every forward after the prefill
    commits its accepted drafts plus one token of the target's own, and the prefill commits the first."""
    completion = answer["outputs"][0][0]
    tokens = [int(t) for t in completion["ids"]]
    eos = completion.get("finish_reason") == "stop"
    if eos and eos_token_ids and (not tokens or tokens[-1] not in eos_token_ids):
        tokens.append(int(eos_token_ids[0]))
    result = {"token_ids": tokens, "wall_time": wall, "finish_reason": "eos" if eos else "length",
              "decoding_steps": len(tokens), "prefill_seconds": completion.get("prefill_seconds")}
    if drafting:
        spec = completion.get("spec_decode") or {}
        steps, drafted = spec.get("per_step_accepted", []), spec.get("per_step_drafted", [])
        accepted = int(spec.get("num_accepted_draft_tokens", sum(steps)))
        per_position, reached = _per_position(steps, drafted)
        plain_steps = len(tokens) - accepted - len(steps)  # forwards that verified no draft (prefill included)
        result |= {"decoding_steps": len(tokens) - accepted, "draft_tokens_proposed": int(spec.get("num_draft_tokens",
                   sum(drafted))), "draft_tokens_accepted": accepted, "accepted_per_position": per_position,
                   "reached_per_position": reached,
                   "accept_lengths": [1] * max(plain_steps, 0) + [n + 1 for n in steps],
                   "engine_counters": engine_counters(answer.get("counters") or {})}
    return make(**result)
