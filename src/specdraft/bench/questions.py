"""Benchmark questions in Spec-Bench's format, their subtasks, selection, and multi-turn prompts.

A question file has one JSON object a line: ``question_id``, ``category``, ``turns`` (list of user turns) and an
optional ``reference``. Spec-Bench (Xia et al. 2024) groups its 13 categories into six subtasks: the eight MT-bench
categories form ``mt_bench``; translation, summarization, qa, math_reasoning and rag are their own subtask.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from specdraft.errors import SpecdraftError, json_error
from specdraft.files import text_lines
from specdraft.prompts import BUILTIN_PROMPTS, encode_prompts

BUILTIN = "builtin"
SHAREGPT_HELDOUT = "sharegpt-heldout"  # the held-out ShareGPT first prompts (never in distillation data)
GENERATED_SOURCES = (BUILTIN, SHAREGPT_HELDOUT)  # question sources that are not files
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
SPEC_BENCH_SUBTASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
SUBTASKS = (*SPEC_BENCH_SUBTASKS, "sharegpt")  # plus the held-out ShareGPT prompts, a subtask of its own
CATEGORY_TO_SUBTASK: dict[str, str] = {c: "mt_bench" for c in MT_BENCH_CATEGORIES} | {s: s for s in SUBTASKS}


@dataclass(frozen=True)
class Question:
    """One benchmark question: ``turns`` are the user turns, answered one after the other."""

    question_id: int | str
    category: str
    turns: tuple[str, ...]
    reference: tuple[str, ...] | None = None

    @property
    def subtask(self) -> str:
        return CATEGORY_TO_SUBTASK[self.category]


def subtask_of(category: str) -> str:
    """Spec-Bench subtask of a category (``writing`` -> ``mt_bench``); SpecdraftError when unknown."""
    if category not in CATEGORY_TO_SUBTASK:
        raise SpecdraftError(f"unknown category {category!r}; known: {', '.join(CATEGORY_TO_SUBTASK)}")
    return CATEGORY_TO_SUBTASK[category]


def builtin_questions() -> list[Question]:
    """``specdraft.prompts.BUILTIN_PROMPTS`` as single-turn questions numbered 1, 2, ..."""
    return [Question(i, p.category, (p.text,)) for i, p in enumerate(BUILTIN_PROMPTS, start=1)]


def sharegpt_heldout_questions() -> list[Question]:
    """The held-out split of ShareGPT first prompts (``specdraft.corpus.sharegpt_prompts(split="heldout")``)
    as single-turn questions of category ``sharegpt``: chat prompts the drafter was never trained on."""
    from specdraft.corpus import sharegpt_prompts

    return [Question(f"sharegpt:{r.id}", "sharegpt", (r.text,)) for r in sharegpt_prompts(split="heldout")]


def _parse_line(text: str, where: str) -> Question:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecdraftError(f"{where}: not valid JSON ({json_error(exc)})") from None
    if not isinstance(obj, dict):
        raise SpecdraftError(f"{where}: expected a JSON object")
    missing = [k for k in ("question_id", "category", "turns") if k not in obj]
    if missing:
        raise SpecdraftError(f"{where}: missing {', '.join(missing)}")
    qid, category, turns = obj["question_id"], obj["category"], obj["turns"]
    if isinstance(qid, bool) or not isinstance(qid, (int, str)):
        raise SpecdraftError(f"{where}: question_id must be an integer or a string")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise SpecdraftError(f"{where}: turns must be a non-empty list of non-empty strings")
    if not isinstance(category, str) or category not in CATEGORY_TO_SUBTASK:
        raise SpecdraftError(f"{where}: unknown category {category!r}; known: {', '.join(CATEGORY_TO_SUBTASK)}")
    reference = obj.get("reference")
    reference = tuple(str(r) for r in reference) if isinstance(reference, list) else None
    return Question(qid, category, tuple(turns), reference)


def load_questions(source: str | Path) -> list[Question]:
    """Questions from a Spec-Bench-format JSONL file, the built-in suite (``"builtin"``), or the held-out ShareGPT
    prompts (``"sharegpt-heldout"``).

    Raises SpecdraftError for a missing file, a malformed line (naming its line number), an unknown category or a
    duplicate question_id.
    """
    if str(source) == BUILTIN:
        return builtin_questions()
    if str(source) == SHAREGPT_HELDOUT:
        return sharegpt_heldout_questions()
    path = Path(source)
    if not path.is_file():
        raise SpecdraftError(f"question file not found: {path}")
    questions, seen = [], set()
    for number, line in text_lines(path):
        if not line.strip():
            continue
        question = _parse_line(line, f"{path}, line {number}")
        if question.question_id in seen:
            raise SpecdraftError(f"{path}, line {number}: duplicate question_id {question.question_id!r}")
        seen.add(question.question_id)
        questions.append(question)
    if not questions:
        raise SpecdraftError(f"question file has no questions: {path}")
    return questions


def select_questions(
    questions: Sequence[Question], categories: Iterable[str] | None = None, per_category: int | None = None
) -> list[Question]:
    """Keep questions of the given subtasks (or original categories), then the first ``per_category`` of each
    subtask, in file order (deterministic)."""
    wanted = set(categories or ())
    unknown = sorted(wanted - set(CATEGORY_TO_SUBTASK))
    if unknown:
        raise SpecdraftError(f"unknown category {', '.join(unknown)}; subtasks: {', '.join(SUBTASKS)}")
    kept, counts = [], dict.fromkeys(SUBTASKS, 0)
    for q in questions:
        if wanted and q.subtask not in wanted and q.category not in wanted:
            continue
        if per_category is not None and counts[q.subtask] >= per_category:
            continue
        counts[q.subtask] += 1
        kept.append(q)
    if not kept:
        raise SpecdraftError("no question left after selecting --categories / --per-category")
    return kept


def conversation_ids(tokenizer, turns: Sequence[str], answers: Sequence[str]) -> list[int]:
    """Chat-template token ids of user ``turns[: len(answers) + 1]`` interleaved with the model's own ``answers``
    as assistant turns, ending with the generation prompt for the next answer."""
    if not getattr(tokenizer, "chat_template", None):
        raise SpecdraftError("the benchmark needs a target tokenizer with a chat template; this one has none")
    messages = []
    for user, assistant in zip(turns, [*answers, None], strict=False):
        messages.append({"role": "user", "content": user})
        if assistant is not None:
            messages.append({"role": "assistant", "content": assistant})
    return encode_prompts(tokenizer, [messages])[0]
