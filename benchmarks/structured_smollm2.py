"""JSON-schema answers of the built-in target (SmolLM2-135M-Instruct) under speculation: validity, greedy equality
with plain constrained decoding, τ and tokens/s.

Each request (a schema with nested objects, enums, arrays and numbers, and a question) runs, in turn in one process:
plain constrained greedy decoding (no drafter), speculative constrained greedy decoding with the shipped drafter
alone, with the shipped drafter and the grammar as a drafter (the tokens the grammar forces spliced into its chain,
:mod:`specdraft.drafters.grammar_draft`), with the grammar drafter alone, and speculative constrained sampling at
temperature 0.8 (seeded; ``--no-sampled`` leaves it out). Every answer that ends with the end-of-sequence token is
validated against its Pydantic model; greedy speculative answers are compared with plain ones token for token. The
grammar is the server's (:class:`specdraft.grammar.GrammarCompiler`), so this is what ``specdraft serve`` does
for ``response_format: json_schema`` (with the grammar drafter), without HTTP.

    PYTHONPATH=src .venv/bin/python benchmarks/structured_smollm2.py [--requests 50] [--max-new-tokens 160] \
        [--no-sampled] [--weights gguf|float32]

Needs the grammar extra (xgrammar). Prints one line per request and a summary, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import replace
from typing import Literal

import torch
from pydantic import BaseModel, Field

from specdraft.api import eos_token_ids, load_drafter, load_target
from specdraft.decoding import generate
from specdraft.grammar import GrammarCompiler
from specdraft.models.registry import SMOLLM2, SMOLLM2_DRAFTER
from specdraft.sampling import SamplingConfig
from specdraft.sequence import GenerationConfig


class Address(BaseModel):
    city: str = Field(max_length=30)
    country: str = Field(max_length=30)


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=120)
    role: Literal["engineer", "teacher", "doctor", "artist", "other"]
    address: Address


class Item(BaseModel):
    item: str = Field(max_length=30)
    grams: float = Field(ge=0, le=5000)


class Recipe(BaseModel):
    title: str = Field(max_length=50)
    servings: int = Field(ge=1, le=12)
    difficulty: Literal["easy", "medium", "hard"]
    ingredients: list[Item] = Field(min_length=1, max_length=5)


class Forecast(BaseModel):
    city: str = Field(max_length=30)
    condition: Literal["sunny", "cloudy", "rain", "snow"]
    high_c: float = Field(ge=-50, le=60)
    low_c: float = Field(ge=-60, le=50)
    alerts: list[str] = Field(max_length=3)


class Book(BaseModel):
    title: str = Field(max_length=60)
    author: Person
    year: int = Field(ge=1400, le=2030)
    genres: list[Literal["fiction", "history", "science", "poetry", "fantasy"]] = Field(min_length=1, max_length=3)


class Order(BaseModel):
    order_id: int = Field(ge=1, le=999999)
    status: Literal["pending", "shipped", "delivered"]
    items: list[Item] = Field(min_length=1, max_length=4)
    total: float = Field(ge=0, le=100000)


MODELS = [Person, Recipe, Forecast, Book, Order]
QUESTIONS = {
    Person: ["a nurse who lives in Lyon", "the inventor of the telephone", "a painter from Madrid",
             "a retired teacher in Boston", "a young software engineer in Nairobi", "a doctor in Oslo",
             "a sculptor in Florence", "a chemistry teacher in Seoul", "a violinist from Vienna",
             "an engineer who builds bridges in Lisbon"],
    Recipe: ["pancakes", "tomato soup", "a green salad", "chocolate cake", "fried rice", "guacamole",
             "banana bread", "lentil curry", "omelette", "pizza dough"],
    Forecast: ["Paris tomorrow", "Cairo in summer", "Moscow in January", "London in autumn", "Tokyo in spring",
               "Sydney today", "Chicago in a winter storm", "Mumbai in the monsoon", "Reykjavik at night",
               "Lima this week"],
    Book: ["a classic novel about a whale", "a history of Rome", "a book of poems about the sea",
           "a fantasy story with dragons", "a popular science book about stars", "a detective novel",
           "a book about the French revolution", "a children's fantasy book", "a biography of a scientist",
           "a collection of love poems"],
    Order: ["two books and a lamp", "groceries for a week", "a laptop", "three shirts", "garden tools",
            "a bicycle and a helmet", "coffee beans", "a phone case", "paint and brushes", "a tent"],
}


def requests(count: int) -> list[tuple[type[BaseModel], str]]:
    pairs = [(model, question) for i in range(10) for model in MODELS for question in [QUESTIONS[model][i]]]
    return pairs[:count]


def prompt_ids(tokenizer, model: type[BaseModel], question: str) -> list[int]:
    schema = json.dumps(model.model_json_schema())
    messages = [{"role": "system", "content": f"Answer only with JSON that follows this schema: {schema}"},
                {"role": "user", "content": f"Give me {model.__name__.lower()} data for {question}."}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]


def run(target, ids, drafter, config, seed: int | None = None) -> dict:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    start = time.perf_counter()
    result = generate(target, ids, drafter, config, generator)
    seconds = time.perf_counter() - start
    return {"tokens": result.token_ids, "finish": result.finish_reason, "seconds": seconds,
            "new_tokens": result.stats.new_tokens, "forwards": result.stats.target_forward_calls}


def valid(tokenizer, model: type[BaseModel], out: dict, eos: tuple[int, ...]) -> bool:
    if out["finish"] != "eos":
        return False
    text = tokenizer.decode([t for t in out["tokens"] if t not in eos])
    try:
        model.model_validate_json(text)
    except ValueError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--no-sampled", action="store_true", help="leave out the sampled run")
    parser.add_argument("--weights", choices=["gguf", "float32"], default="float32",
                        help="the target's GGUF blocks (what specdraft serve decodes by default) or dense float32")
    args = parser.parse_args()
    target, tokenizer = load_target(SMOLLM2, quantize="gguf" if args.weights == "gguf" else None)
    drafter = load_drafter(target, tokenizer, draft=SMOLLM2_DRAFTER)
    eos = eos_token_ids(tokenizer, SMOLLM2)
    compiler = GrammarCompiler(tokenizer, target.vocab_size, eos)
    generate(target, [1, 2, 3], None, GenerationConfig(4))  # warm-up
    names = ["plain", "speculative", "grammar", "grammar_alone"] + ([] if args.no_sampled else ["sampled"])
    greedy_spec = ["speculative", "grammar", "grammar_alone"]
    rows, totals = [], {name: [0, 0, 0.0] for name in names}
    for i, (model, question) in enumerate(requests(args.requests)):
        ids = prompt_ids(tokenizer, model, question)
        grammar = compiler.json_schema(model.model_json_schema())
        greedy = GenerationConfig(args.max_new_tokens, args.num_draft_tokens, eos_token_ids=eos,
                                  speculation="fixed", logits_processor=grammar)
        forced = replace(greedy, grammar_draft=True)
        sampled = GenerationConfig(args.max_new_tokens, args.num_draft_tokens, SamplingConfig(0.8), eos_token_ids=eos,
                                   speculation="fixed", logits_processor=grammar)
        setups = {"plain": (None, greedy, None), "speculative": (drafter, greedy, None),
                  "grammar": (drafter, forced, None), "grammar_alone": (None, forced, None),
                  "sampled": (drafter, sampled, i)}  # (drafter, config, seed)
        outs = {name: run(target, ids, *setups[name]) for name in names}
        for name, out in outs.items():
            totals[name][0] += out["new_tokens"]
            totals[name][1] += out["forwards"]
            totals[name][2] += out["seconds"]
        row = {"schema": model.__name__, "question": question} | {
            f"equal_{name}": outs["plain"]["tokens"] == outs[name]["tokens"] for name in greedy_spec} | {
            f"valid_{name}": valid(tokenizer, model, out, eos) for name, out in outs.items()}
        row |= {f"{name}_tokens": out["new_tokens"] for name, out in outs.items()}
        row |= {f"{name}_forwards": out["forwards"] for name, out in outs.items()}
        row |= {f"{name}_seconds": round(out["seconds"], 2) for name, out in outs.items()}
        rows.append(row)
        print(f"{i:2d} {model.__name__:8s} equal spec/grammar/alone " + "/".join(
            str(row[f"equal_{name}"]) for name in greedy_spec) + " valid " + "/".join(
            str(row[f"valid_{name}"]) for name in names) + " tokens " + "/".join(
            str(row[f"{name}_tokens"]) for name in names) + " forwards " + "/".join(
            str(row[f"{name}_forwards"]) for name in names) + " seconds " + "/".join(
            str(row[f"{name}_seconds"]) for name in names), flush=True)
    summary = {name: {"tokens": t, "forwards": f, "seconds": round(s, 2), "tau": round(t / f, 3),
                      "tokens_per_second": round(t / s, 2)} for name, (t, f, s) in totals.items()}
    counts = {key: sum(row[key] for row in rows) for key in [f"equal_{name}" for name in greedy_spec] +
              [f"valid_{name}" for name in names]}
    print(f"{len(rows)} requests: {counts}; " + "; ".join(
        f"{name} τ {s['tau']:.2f}, {s['tokens_per_second']:.1f} tokens/s" for name, s in summary.items()))
    print(json.dumps({"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                      "weights": args.weights,
                      "num_draft_tokens": args.num_draft_tokens, "max_new_tokens": args.max_new_tokens,
                      "counts": counts, "summary": summary, "rows": rows}))


if __name__ == "__main__":
    main()
