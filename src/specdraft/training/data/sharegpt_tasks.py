"""The ``sharegpt-tasks`` prompt source: prompts in the shapes of Spec-Bench's six subtasks (Xia et al. 2024, arXiv
2401.07851), built from ShareGPT conversations of one split, offline and deterministically.

Goel et al. (2024) distil the drafter on the target's responses to real prompts; a drafter distilled on short
English opening turns has never seen a long context, a German input or a word problem. Each kind here is built
from the text of ShareGPT conversations (never from Spec-Bench's questions):

- ``chat``: an English opening human turn of 10-300 characters (as the ``sharegpt`` source);
- ``translation``: "Translate German to English: " + one German sentence of 40-250 characters, split from a
  German human or assistant turn, with WMT's spaces before punctuation (:func:`task_prompts.wmt_spacing`);
- ``summarization``: "Summarize: " + an English assistant turn without code of 1,500-4,000 characters, on one line;
- ``qa``: an English human question of 10-100 characters ending in "?";
- ``math_reasoning``: an English human turn with numbers and a quantity question ("how many", "total", "cost",
  ...), and nothing that looks like code;
- ``rag``: 2-4 English passages (assistant turns on one line each, the answer to the question among them, in
  shuffled order), then the question (that conversation's opening human turn) on the last line; 2,000-4,000
  characters in all.

The split is by conversation (:func:`~specdraft.corpus.split_of`): a prompt of one split is built only from
conversations of that split (rag's other passages included), and a train prompt any of whose source texts also
occurs in a held-out conversation is dropped. Each kind is shuffled with a fixed seed, then the kinds take turns,
so any prefix (``--limit N``) is a balanced mix. Prompt ids are ``sharegpt-tasks:<kind>:<conversation>:<n>``.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from specdraft import corpus
from specdraft.errors import SpecdraftError
from specdraft.training.data.task_prompts import is_german, wmt_spacing

SHAREGPT_TASKS = "sharegpt-tasks"
KINDS = ("chat", "translation", "summarization", "qa", "math_reasoning", "rag")

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
_CODE_OR_MARKUP = re.compile(r"```|[{}<>|#*\\_]|https?://|\b(def|import|return|print|function|SELECT)\b")
_CODE_CHARS = re.compile(r"```|[{};<>\\]")
_CODE_WORDS = re.compile(r"\b(def|import|return|print|function|select|python|code|excel|formula|sql)\b")
_QUANTITY = re.compile(r"\b(how many|how much|how long|how far|how old|total|altogether|in all|cost|costs|left)\b",
                       re.IGNORECASE)
_TASK_WORDS = re.compile(r"\b(write|create|generate|rewrite|article|essay|error|install|command|file|table|list)\b",
                         re.IGNORECASE)
_GERMAN_HINTS = (" und ", " der ", " die ", " das ", " ist ", " nicht ", " ich ", " sie ", " mit ", " für ")
_QUESTION_WORD = re.compile(r"^(who|what|when|where|which|how|why|is|are|was|were|do|does|did|can)\b", re.IGNORECASE)
_BACK_REFERENCE = re.compile(r"\b(this|that|it|these|those|them|above|previous|you)\b", re.IGNORECASE)
_NUMBER = re.compile(r"\d+(?:[.,]\d+)?")
_SPACES = re.compile(r"\s+")
_SENTENCES_PER_TURN = 8  # German sentences taken from one turn, so one long German text does not fill the kind
_DISTRACTORS = 64  # recent passages of the split that rag draws its other passages from


@dataclass
class _Candidates:
    """Prompts of one split by kind, each with the source texts it was built from."""

    by_kind: dict[str, list[tuple[str, str, tuple[str, ...]]]] = field(
        default_factory=lambda: {kind: [] for kind in KINDS})  # kind -> [(prompt id, prompt, source texts)]
    passages: list[str] = field(default_factory=list)  # recent one-line English assistant turns (rag distractors)
    seen: set[str] = field(default_factory=set)  # prompt texts already taken

    def add(self, kind: str, pid: str, prompt: str, sources: tuple[str, ...]) -> None:
        if prompt not in self.seen:
            self.seen.add(prompt)
            self.by_kind[kind].append((pid, prompt, sources))


def one_line(text: str) -> str:
    """``text`` with every run of white space (new lines included) turned into one space."""
    return _SPACES.sub(" ", text).strip()


def is_word_problem(text: str) -> bool:
    """An arithmetic word problem: English prose of 50-800 characters in at most three lines with a question mark,
    at least two numbers, a quantity word ("how many", "how much", "total", "cost", ...), no code (fences, braces,
    semicolons, "python", "excel", "formula"...) and no writing or computer task ("write", "article", "error"...)."""
    return (50 <= len(text) <= 800 and text.count("\n") <= 2 and "?" in text and len(_NUMBER.findall(text)) >= 2
            and bool(_QUANTITY.search(text)) and not _TASK_WORDS.search(text) and is_prose(text))


def is_prose(text: str) -> bool:
    """English (:func:`~specdraft.corpus.looks_english`) without code: no fences, braces, semicolons,
    angle brackets or backslashes, and no words such as "def", "import", "python", "sql", "excel", "formula"."""
    return not _CODE_CHARS.search(text) and corpus.looks_english(text) and not _CODE_WORDS.search(text.lower())


def is_short_question(text: str, opening: bool) -> bool:
    """An English question of 10-100 characters ending in "?"; a later turn must also start with a question word
    and not point back at the conversation ("this", "it", "above", "you"...)."""
    if not (10 <= len(text) <= 100 and text.endswith("?") and "\n" not in text):
        return False
    return (opening or (bool(_QUESTION_WORD.match(text)) and not _BACK_REFERENCE.search(text))) and \
        corpus.looks_english(text)


def german_sentences(text: str) -> list[str]:
    """The German sentences of 40-250 characters (after WMT spacing) of a German text, without code or markup."""
    if not any(hint in text for hint in _GERMAN_HINTS) or not is_german(text):
        return []
    out = []
    for piece in _SENTENCE_END.split(text):
        sentence = wmt_spacing(piece)
        if 40 <= len(sentence) <= 250 and not _CODE_OR_MARKUP.search(sentence) and "\u00a8" not in sentence \
                and is_german(sentence, 6):
            out.append(sentence)
    return out


def _turns(conversation: dict) -> list[tuple[str, str]]:
    """(speaker, stripped text) of the well-formed, non-empty turns."""
    return [(t["from"], t["value"].strip()) for t in conversation["conversations"]
            if isinstance(t, dict) and t.get("from") in ("human", "gpt") and isinstance(t.get("value"), str)
            and t["value"].strip()]


def _collect(conversation: dict, found: _Candidates, seed: int) -> None:
    """Add the candidates of every kind that one conversation yields."""
    cid, turns = conversation["id"], _turns(conversation)
    rng = random.Random(f"{seed}:{cid}")  # str seeds hash with SHA-512: the same on every run
    opening = corpus.opening_prompt(conversation)
    for n, (speaker, text) in enumerate(turns):
        sentences = german_sentences(text)
        for i, sentence in enumerate(sorted(rng.sample(sentences, min(len(sentences), _SENTENCES_PER_TURN)),
                                            key=sentences.index)):
            found.add("translation", f"{SHAREGPT_TASKS}:translation:{cid}:{n}.{i}",
                      "Translate German to English: " + sentence, (text,))
        if speaker == "human" and not sentences:
            if is_word_problem(text):
                found.add("math_reasoning", f"{SHAREGPT_TASKS}:math_reasoning:{cid}:{n}", text, (text,))
            elif is_short_question(text, opening=n == 0 and text == opening):
                found.add("qa", f"{SHAREGPT_TASKS}:qa:{cid}:{n}", text, (text,))
    if 10 <= len(opening) <= 300 and corpus.looks_english(opening):
        found.add("chat", f"{SHAREGPT_TASKS}:chat:{cid}:0", opening, (opening,))
    documents = [(n, t) for n, (s, t) in enumerate(turns) if s == "gpt" and 1500 <= len(t) <= 8000
                 and 1500 <= len(one_line(t)) <= 4000 and is_prose(t)]
    if documents:
        n, text = rng.choice(documents)
        found.add("summarization", f"{SHAREGPT_TASKS}:summarization:{cid}:{n}", "Summarize: " + one_line(text),
                  (text,))
    _collect_rag(cid, opening, turns, found, rng)


def _collect_rag(cid: str, question: str, turns: list[tuple[str, str]], found: _Candidates,
                 rng: random.Random) -> None:
    """A rag prompt from the opening question, its answer and recent passages of the split; then remember this
    conversation's passages as distractors for later ones."""
    passages = [(t, one_line(t)) for s, t in turns if s == "gpt" and 300 <= len(t) <= 2000 and is_prose(t)]
    answer = turns[1][1] if len(turns) > 1 and turns[1][0] == "gpt" else ""
    if (10 <= len(question) <= 200 and question.endswith("?") and corpus.looks_english(question) and passages
            and passages[0][0] == answer and len(found.passages) >= 3):
        want, chosen = rng.randint(2, 4), [passages[0]]
        for other in rng.sample(found.passages, 3):
            if len(chosen) >= want and _rag_chars(chosen, question) >= 2000:
                break
            if _rag_chars(chosen + [other], question) <= 4000:
                chosen.append(other)
        if len(chosen) >= 2 and 2000 <= _rag_chars(chosen, question) <= 4000:
            rng.shuffle(chosen)
            found.add("rag", f"{SHAREGPT_TASKS}:rag:{cid}:0", "\n".join(p for _, p in chosen) + "\n" + question,
                      (question,) + tuple(t for t, _ in chosen))
    found.passages = (found.passages + passages)[-_DISTRACTORS:]


def _rag_chars(passages: list[tuple[str, str]], question: str) -> int:
    return sum(len(p) + 1 for _, p in passages) + len(question)


def sharegpt_task_prompts(split: str = "train", seed: int = 0, path: str | Path | None = None,
                          heldout_fraction: float = corpus.HELDOUT_FRACTION) -> list[tuple[str, list[dict]]]:
    """(prompt id, one-turn chat) for the task-shaped prompts of ``split`` (module docstring), the kinds taking
    turns: chat, translation, summarization, qa, math_reasoning, rag, chat, ...; a kind that runs out drops out.

    One pass over the ShareGPT file; the same file, split and ``seed`` give the same list on every run.
    """
    if split not in corpus.SPLITS:
        raise SpecdraftError(f"split must be one of {', '.join(corpus.SPLITS)}, got {split!r}")
    found, heldout_texts = _Candidates(), set()
    for conversation in corpus.iter_sharegpt(path):
        in_split = split == "all" or corpus.split_of(conversation["id"], heldout_fraction) == split
        if in_split:
            _collect(conversation, found, seed)
        elif split == "train":
            heldout_texts.update(text for _, text in _turns(conversation))
    pools = []
    for kind in KINDS:
        pool = [(pid, prompt) for pid, prompt, sources in found.by_kind[kind]
                if heldout_texts.isdisjoint(sources)]
        random.Random(f"{seed}:{kind}").shuffle(pool)
        pools.append(pool)
    mixed = [pool[i] for i in range(max(map(len, pools), default=0)) for pool in pools if i < len(pool)]
    return [(pid, [{"role": "user", "content": prompt}]) for pid, prompt in mixed]


def kind_of(prompt_id: str) -> str | None:
    """The kind of a ``sharegpt-tasks`` prompt id, or None for a prompt of another source."""
    parts = prompt_id.split(":")
    return parts[1] if len(parts) > 2 and parts[0] == SHAREGPT_TASKS and parts[1] in KINDS else None
