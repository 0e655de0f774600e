"""xgrammar against llguidance on SmolLM2's tokenizer (49,152 tokens): tokenizer set-up, compiling a JSON schema
(nested object, enum, array, numbers), and the time to fill one token mask at each position of a valid answer.

Both libraries run in one process, alternately, ``--rounds`` times; each round compiles afresh (no cache). Masks
are filled along the same 58-token answer, whitespace flexible in both (each library's default for a schema).

    PYTHONPATH=src .venv/bin/python benchmarks/grammar_libraries.py [--rounds 3]

Needs ``pip install xgrammar llguidance``. Prints one line per library and round, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

SMOL = Path(__file__).resolve().parent.parent / "src/specdraft/weights/smollm2-135m-instruct-drafter"
VOCAB = 49152
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "score": {"type": "number"},
    "color": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "score", "color", "tags", "address"], "additionalProperties": False}
ANSWER = {"name": "Ada Lovelace", "age": 36, "score": 9.5, "color": "green", "tags": ["math", "poetry"],
          "address": {"city": "London", "zip": "W1"}}


def _ms(seconds: float) -> float:
    return round(1e3 * seconds, 3)


def xgrammar_round(tokenizer, ids: list[int]) -> dict:
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB)
    ready = time.perf_counter()
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compiled_at = time.perf_counter()
    matcher, bitmask, masks = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, VOCAB), []
    for token in ids:
        tick = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        masks.append(time.perf_counter() - tick)
        assert matcher.accept_token(token)
    return {"tokenizer_ms": _ms(ready - start), "compile_ms": _ms(compiled_at - ready), "masks": masks}


def llguidance_round(tokenizer, ids: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    start = time.perf_counter()
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB)
    ready = time.perf_counter()
    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    compiled_at = time.perf_counter()
    bitmask, masks = llguidance.torch.allocate_token_bitmask(1, VOCAB), []
    for token in ids:
        tick = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        masks.append(time.perf_counter() - tick)
        assert matcher.consume_token(token), matcher.get_error()
    return {"tokenizer_ms": _ms(ready - start), "compile_ms": _ms(compiled_at - ready), "masks": masks}


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternate rounds of both libraries")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(SMOL)
    ids = tokenizer(json.dumps(ANSWER))["input_ids"]
    rows = []
    for round_ in range(args.rounds):
        for name, run in (("xgrammar", xgrammar_round), ("llguidance", llguidance_round)):
            result = run(tokenizer, ids)
            masks = result.pop("masks")
            result |= {"library": name, "round": round_, "mask_median_us": round(1e6 * statistics.median(masks), 1),
                       "mask_mean_us": round(1e6 * statistics.mean(masks), 1),
                       "mask_max_us": round(1e6 * max(masks), 1)}
            rows.append(result)
            print(f"{name:10s} round {round_}: tokenizer {result['tokenizer_ms']:.0f} ms, compile "
                  f"{result['compile_ms']:.1f} ms, mask median {result['mask_median_us']:.0f} us, mean "
                  f"{result['mask_mean_us']:.0f} us, max {result['mask_max_us']:.0f} us ({len(ids)} positions)")
    print(json.dumps({"machine": platform.processor() or platform.machine(), "answer_tokens": len(ids), "rows": rows}))


if __name__ == "__main__":
    main()
