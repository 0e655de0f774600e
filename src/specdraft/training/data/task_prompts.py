"""Task-shaped distillation prompts: instructions in the form of Spec-Bench's five single-turn subtasks (Xia et al.
2024, arXiv 2401.07851: WMT14 de-en translation, CNN/DM summarization, Natural Questions qa, GSM8K
math_reasoning, NQ with retrieved passages rag), built from text that is available offline and is not Spec-Bench's.

Goel et al. (2024) distil on the target's responses to real instructions; a drafter distilled only on chat first
turns is then well aligned on chat and poorly on tasks whose responses look different (a translation, a summary
that copies its article, a worked sum). These builders cover those shapes:

- ``translation``: "Translate German to English: " + a German sentence from ShareGPT, with WMT's spaces before
  punctuation;
- ``summarization``: "Summarize: " + an English prose document (a long ShareGPT assistant turn without code);
- ``qa``: a short factual question (a Who/When/Where/Which/How-many... sentence found inside ShareGPT text);
- ``math_reasoning``: a grade-school word problem from this module's own templates with random names and numbers;
- ``rag``: passages (the assistant's answer to a question plus an unrelated distractor answer, shuffled), a line
  break, then the question, as Spec-Bench's rag prompts are laid out.

Only conversations of the ShareGPT ``train`` split are read, so the held-out ShareGPT benchmark prompts stay held
out; the Spec-Bench questions themselves are never used.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from specdraft.corpus import iter_sharegpt, looks_english, split_of
from specdraft.errors import SpecdraftError

TASKS = ("translation", "summarization", "qa", "math_reasoning", "rag")
_GERMAN_WORDS = frozenset("der die das und ist nicht ein eine ich mit sie auf für den dem zu von sich auch wie wir "
                          "es im des bei nach wird werden oder aber".split())
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
_QUESTION = re.compile(r"^(Who|When|Where|Which|How many|How much|How long|How old|In which|In what|What year|"
                       r"What is the name|What was the|What is the (capital|population|largest|highest|biggest))"
                       r" [^?\n]{8,90}\?$")
_CODE_OR_MARKUP = re.compile(r"```|[{}<>|#*\\=_]|https?://")


@dataclass(frozen=True)
class TaskPrompt:
    """One prompt: its Spec-Bench subtask and the user turn."""

    category: str
    prompt: str


@dataclass
class _Pools:
    """Raw material gathered in one pass over the ShareGPT train split."""

    german: list[str]
    documents: list[str]
    questions: list[str]
    answered: list[tuple[str, str]]  # (question, the assistant's answer)


def wmt_spacing(sentence: str) -> str:
    """A space before each punctuation mark that ends a word, as in WMT14's tokenised German ("ist , da")."""
    return re.sub(r"(?<=\S)([,.;:!?])(?=\s|$)", r" \1", sentence.strip())


def is_german(text: str, min_words: int = 8, min_share: float = 0.2) -> bool:
    """At least ``min_words`` words, of which at least ``min_share`` are frequent German function words."""
    words = re.findall(r"[a-zäöüß]+", text.lower())
    return len(words) >= min_words and sum(w in _GERMAN_WORDS for w in words) >= min_share * len(words)


def _prose(text: str, min_chars: int, max_chars: int) -> bool:
    return min_chars <= len(text) <= max_chars and not _CODE_OR_MARKUP.search(text) and looks_english(text)


def _gather(conversations: Iterable[dict]) -> _Pools:
    pools = _Pools([], [], [], [])
    seen: set[str] = set()
    for conversation in conversations:
        if split_of(conversation["id"]) != "train":
            continue
        turns = [t for t in conversation["conversations"] if isinstance(t, dict) and isinstance(t.get("value"), str)]
        for turn in turns:
            text = turn["value"].strip()
            if text in seen:
                continue
            seen.add(text)
            if is_german(text):
                pools.german += [s.strip() for s in _SENTENCE_END.split(text)
                                 if 8 <= len(s.split()) <= 40 and not _CODE_OR_MARKUP.search(s) and is_german(s, 6)]
            elif turn.get("from") == "gpt" and _prose(text, 1500, 6000):
                pools.documents.append(text)
            if looks_english(text):
                pools.questions += [s.strip() for s in _SENTENCE_END.split(text) if _QUESTION.match(s.strip())]
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            question, answer = turns[0]["value"].strip(), turns[1]["value"].strip()
            if 15 <= len(question) <= 200 and looks_english(question) and _prose(answer, 600, 3000):
                pools.answered.append((question, answer))
    pools.german = list(dict.fromkeys(pools.german))
    pools.questions = list(dict.fromkeys(pools.questions))
    return pools


def _sample(items: list, count: int, rng: random.Random) -> list:
    return rng.sample(items, min(count, len(items)))


def _rag(answered: list[tuple[str, str]], count: int, rng: random.Random) -> list[str]:
    """Passages (the answer and a distractor answer, in random order), a line break, then the question."""
    prompts = []
    for question, answer in _sample(answered, count, rng):
        distractor = rng.choice(answered)[1]
        passages = [answer, distractor] if rng.random() < 0.5 else [distractor, answer]
        prompts.append(" ".join(p.replace("\n", " ") for p in passages) + "\n" + question)
    return prompts


def build_task_prompts(per_task: int, seed: int = 0, conversations: Iterable[dict] | None = None) -> list[TaskPrompt]:
    """Up to ``per_task`` prompts for each of :data:`TASKS` (fewer where the source has fewer), in task order.

    ``conversations`` defaults to the packaged ShareGPT file (:func:`~specdraft.corpus.iter_sharegpt`).
    """
    if per_task < 1:
        raise SpecdraftError(f"per_task must be >= 1, got {per_task}")
    rng = random.Random(seed)
    pools = _gather(iter_sharegpt() if conversations is None else conversations)
    texts = {
        "translation": ["Translate German to English: " + wmt_spacing(s) for s in _sample(pools.german, per_task, rng)],
        "summarization": ["Summarize: " + d.replace("\n", " ") for d in _sample(pools.documents, per_task, rng)],
        "qa": _sample(pools.questions, per_task, rng),
        "math_reasoning": [word_problem(rng) for _ in range(per_task)],
        "rag": _rag(pools.answered, per_task, rng) if len(pools.answered) >= 2 else [],
    }
    return [TaskPrompt(task, text) for task in TASKS for text in texts[task]]


def write_task_prompts(path: str | Path, prompts: list[TaskPrompt]) -> Path:
    """One JSON object a line (``category``, ``prompt``): the prompt file ``distill-data --prompts`` reads."""
    from specdraft.files import write_text_atomic as _atomic_write

    path = Path(path)
    if not prompts:
        raise SpecdraftError("no task prompts to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, "".join(json.dumps(asdict(p)) + "\n" for p in prompts))  # ASCII JSON: any locale reads it
    return path


# --- grade-school word problems (GSM8K-shaped, written for this project) --------------------------------------------

_NAMES = ("Maria", "James", "Aisha", "Tom", "Lena", "Carlos", "Priya", "Ben", "Yuki", "Omar", "Sofia", "Liam",
          "Grace", "Noah", "Chen", "Emma", "Ravi", "Hannah", "Jack", "Zoe")
_ITEMS = (("apples", "a bag of"), ("pencils", "a box of"), ("cookies", "a tray of"), ("stickers", "a sheet of"),
          ("eggs", "a carton of"), ("marbles", "a jar of"), ("books", "a shelf of"), ("cupcakes", "a box of"))


def word_problem(rng: random.Random) -> str:
    """A two- or three-step arithmetic word problem with random names, items and numbers."""
    name, other = rng.sample(_NAMES, 2)
    item, unit = rng.choice(_ITEMS)
    a, b, c = rng.randint(2, 12), rng.randint(3, 30), rng.randint(2, 9)
    price, hours, pct = rng.choice((2, 3, 4, 5, 8, 12, 15, 20)), rng.randint(2, 8), rng.choice((10, 20, 25, 50))
    templates = (
        f"{name} buys {a} packs of {item}. Each pack has {b} {item}. {name} gives {c} {item} to {other}. "
        f"How many {item} does {name} have left?",
        f"{name} earns ${price} an hour babysitting. This week {name} worked {hours} hours on Saturday and "
        f"{a} hours on Sunday. How much money did {name} earn this week?",
        f"A store sells {unit} {item} for ${price}. {name} buys {a} of them and pays with a ${price * a + b} "
        f"bill. How much change does {name} get?",
        f"{name} has {b * c} {item} and wants to share them equally among {c} friends. How many {item} does "
        f"each friend get?",
        f"{name} reads {b} pages on Monday and twice as many pages on Tuesday. On Wednesday {name} reads {a} "
        f"pages fewer than on Tuesday. How many pages did {name} read in the three days?",
        f"A jacket costs ${price * 10}. It is on sale for {pct}% off. {name} also buys a hat for ${price}. "
        f"How much does {name} spend in total?",
        f"{name} runs {a} miles every weekday and {c} miles on each day of the weekend. How many miles does "
        f"{name} run in {hours} weeks?",
        f"{other} is {b} years old. {name} is {c} years older than {other}. In {a} years, what will be the sum "
        f"of their ages?",
        f"A bus has {b + 20} passengers. At the first stop {a} people get off and {c} get on. At the second "
        f"stop half of the passengers get off. How many passengers are left on the bus?",
        f"{name} plants {a} rows of tomatoes with {b} plants in each row. Each plant gives {c} tomatoes. "
        f"{name} sells the tomatoes for ${price} a dozen. How much money does {name} make?",
    )
    return rng.choice(templates)
