"""Spec-Bench-shaped distillation prompts from offline text (specdraft.training.data.task_prompts)."""

import json
import random
from collections import Counter

import pytest

from specdraft.corpus import prompts_from_jsonl, split_of
from specdraft.errors import SpecdraftError
from specdraft.training.data.task_prompts import (
    TASKS,
    build_task_prompts,
    is_german,
    wmt_spacing,
    word_problem,
    write_task_prompts,
)

GERMAN = ("Die Stadt hat im letzten Jahr eine neue Brücke über den Fluss gebaut, und sie ist sehr schön. "
          "Wir wollen morgen mit dem Zug nach Berlin fahren, weil die Konferenz dort stattfindet.")
ARTICLE = ("The city council approved a new plan for public parks on Monday. " * 30).strip()
ANSWER = ("Solar panels turn sunlight into electricity using cells made of silicon, and the power they make is "
          "stored in batteries or sent to the grid. ") * 6


def _ids(split: str, count: int) -> list[str]:
    found = [f"c{i}" for i in range(5000) if split_of(f"c{i}") == split]
    assert len(found) >= count
    return found[:count]


def _conversation(cid: str, human: str, gpt: str) -> dict:
    return {"id": cid, "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]}


def _corpus(split: str = "train") -> list[dict]:
    ids = iter(_ids(split, 6))
    return [
        _conversation(next(ids), GERMAN, "Here is the translation."),
        _conversation(next(ids), "Tell me about parks.", ARTICLE),
        _conversation(next(ids), "How do solar panels work?", ANSWER),
        _conversation(next(ids), "What are batteries made of?", ANSWER.replace("Solar", "Wind")),
        _conversation(next(ids), "Where was the first bridge of the city built? I wonder.", "Nobody knows."),
        _conversation(next(ids), "Who wrote the first book about the river Rhine?", "I am not sure."),
    ]


def test_each_task_gets_prompts_in_spec_bench_form():
    prompts = build_task_prompts(3, seed=0, conversations=_corpus())
    by_task = {task: [p.prompt for p in prompts if p.category == task] for task in TASKS}
    assert by_task["translation"] and all(p.startswith("Translate German to English: ") for p in by_task["translation"])
    assert "Brücke über den Fluss gebaut , und sie ist sehr schön ." in by_task["translation"][0] + \
        "".join(by_task["translation"])
    assert by_task["summarization"] == ["Summarize: " + ARTICLE]
    assert set(by_task["qa"]) == {"Where was the first bridge of the city built?",
                                  "Who wrote the first book about the river Rhine?"}
    assert len(by_task["math_reasoning"]) == 3
    answers = {"How do solar panels work?": ANSWER, "What are batteries made of?": ANSWER.replace("Solar", "Wind"),
               "Tell me about parks.": ARTICLE}  # the prose answers of 600-3,000 characters
    assert len(by_task["rag"]) == 3
    for rag in by_task["rag"]:  # passages (the answer and a distractor), a line break, then the question
        passages, question = rag.rsplit("\n", 1)
        assert answers[question].strip() in passages and "\n" not in passages


def test_held_out_conversations_are_never_used():
    assert build_task_prompts(3, seed=0, conversations=_corpus("heldout")) == \
        [p for p in build_task_prompts(3, seed=0, conversations=[]) if p.category == "math_reasoning"]


def test_prompts_are_deterministic_in_the_seed_and_capped_per_task():
    first, again = build_task_prompts(2, seed=1, conversations=_corpus()), build_task_prompts(2, 1, _corpus())
    assert first == again
    assert max(Counter(p.category for p in first).values()) <= 2
    with pytest.raises(SpecdraftError, match="per_task"):
        build_task_prompts(0)


def test_wmt_spacing_and_german_detection():
    assert wmt_spacing("Er kam , sah und siegte. Wirklich?") == "Er kam , sah und siegte . Wirklich ?"
    assert wmt_spacing("Version 2.5 ist da.") == "Version 2.5 ist da ."
    assert is_german(GERMAN) and not is_german(ARTICLE) and not is_german("Die Katze")


def test_word_problems_vary_and_end_with_a_question():
    rng = random.Random(0)
    problems = {word_problem(rng) for _ in range(50)}
    assert len(problems) > 40 and all(p.endswith("?") and any(c.isdigit() for c in p) for p in problems)


def test_written_prompts_are_read_by_distill_data(tmp_path):
    prompts = build_task_prompts(2, seed=0, conversations=_corpus())
    path = write_task_prompts(tmp_path / "tasks.jsonl", prompts)
    chats = prompts_from_jsonl(path)
    assert [c[0]["content"] for c in chats] == [p.prompt for p in prompts]
    assert json.loads(path.read_text().splitlines()[0])["category"] == prompts[0].category
    with pytest.raises(SpecdraftError, match="no task prompts"):
        write_task_prompts(tmp_path / "none.jsonl", [])
    assert not (tmp_path / "none.jsonl").exists()
