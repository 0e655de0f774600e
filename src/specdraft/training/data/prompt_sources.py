"""Prompt sources for distillation data: ShareGPT first turns, every ShareGPT human turn with the conversation before
it (multi-turn contexts), Spec-Bench-shaped task prompts built from ShareGPT, and prompt files (such as
``specdraft task-prompts``' output), alone or pooled.

``--prompts`` takes one source or several separated by commas, read in the order given:

- ``sharegpt``: the opening human turn of each conversation (:func:`specdraft.corpus.sharegpt_prompts`);
- ``sharegpt-turns``: every human turn, preceded by the turns before it in its conversation
  (:func:`sharegpt_turn_prompts`);
- ``sharegpt-tasks``: chat, translation, summarization, qa, math_reasoning and rag prompts built from ShareGPT
  conversations, the kinds taking turns (:func:`specdraft.training.data.sharegpt_tasks.sharegpt_task_prompts`);
- a path: a prompt JSON Lines file (:func:`specdraft.corpus.prompts_from_jsonl`).

The held-out split is by conversation, the same hash split as the first-turn source (:func:`split_of`), so no turn
of a held-out conversation is ever a training prompt, and a train turn whose text opens a held-out conversation is
dropped as well.
"""

from __future__ import annotations

from pathlib import Path

from specdraft import corpus
from specdraft.errors import SpecdraftError
from specdraft.training.data.sharegpt_tasks import SHAREGPT_TASKS, sharegpt_task_prompts

SHAREGPT, SHAREGPT_TURNS = "sharegpt", "sharegpt-turns"
_ROLES = {"human": "user", "gpt": "assistant"}


def sharegpt_turn_prompts(split: str = "train", max_chars: int = 300, max_context_chars: int = 4000,
                          english_only: bool = True, path: str | Path | None = None,
                          heldout_fraction: float = corpus.HELDOUT_FRACTION) -> list[tuple[str, list[dict]]]:
    """(prompt id ``sharegpt:<conversation>:<turn>``, chat messages) for every human turn of the conversations in
    ``split`` whose text has 1 to ``max_chars`` characters (and passes :func:`looks_english` if ``english_only``),
    with every earlier turn of its conversation part as context when the whole chat has at most
    ``max_context_chars`` characters.

    A conversation is read while its turns alternate human / assistant from a human turn on (leading assistant
    turns of a later part are skipped); it is cut at the first turn that breaks the pattern or is empty.
    """
    if split not in corpus.SPLITS:
        raise SpecdraftError(f"split must be one of {', '.join(corpus.SPLITS)}, got {split!r}")
    pairs, heldout_openings = [], set()
    for conversation in corpus.iter_sharegpt(path):
        in_split = split == "all" or corpus.split_of(conversation["id"], heldout_fraction) == split
        if split == "train" and not in_split:
            heldout_openings.add(corpus.opening_prompt(conversation))
        elif in_split:
            pairs += _turn_prompts(conversation, max_chars, max_context_chars, english_only)
    if split == "train":
        pairs = [(i, m) for i, m in pairs if m[-1]["content"] not in heldout_openings]
    return pairs


def _turn_prompts(conversation: dict, max_chars: int, max_context_chars: int,
                  english_only: bool) -> list[tuple[str, list[dict]]]:
    turns = conversation["conversations"]
    start = next((i for i, t in enumerate(turns) if isinstance(t, dict) and t.get("from") == "human"), len(turns))
    messages: list[dict] = []
    out, context_chars = [], 0
    for offset, turn in enumerate(turns[start:]):
        expected = "human" if offset % 2 == 0 else "gpt"
        text = turn.get("value") if isinstance(turn, dict) and turn.get("from") == expected else None
        if not isinstance(text, str) or not text.strip():
            break
        messages.append({"role": _ROLES[expected], "content": text.strip()})
        context_chars += len(text.strip())
        if context_chars > max_context_chars:
            break
        if expected == "human" and len(text.strip()) <= max_chars and (not english_only
                                                                         or corpus.looks_english(text)):
            out.append((f"sharegpt:{conversation['id']}:{offset // 2}", [dict(m) for m in messages]))
    return out


def load_prompt_sources(spec: str, split: str = "train", limit: int | None = None) -> list[tuple[str, list[dict]]]:
    """(prompt id, chat messages) pairs from the comma-separated sources of ``spec``, pooled in the order given; at
    most ``limit`` in all. ``split`` applies to the ShareGPT sources (a prompt file is used whole)."""
    parts = [part.strip() for part in spec.split(",") if part.strip()]
    if not parts:
        raise SpecdraftError(f"--prompts names no source: {spec!r}")
    pairs: list[tuple[str, list[dict]]] = []
    for part in parts:
        left = None if limit is None else limit - len(pairs)
        if left is not None and left <= 0:
            break
        if part == SHAREGPT:
            pairs += [(f"sharegpt:{r.id}", r.messages()) for r in corpus.sharegpt_prompts(split=split, limit=left)]
        elif part == SHAREGPT_TURNS:
            pairs += sharegpt_turn_prompts(split=split)[:left]
        elif part == SHAREGPT_TASKS:
            pairs += sharegpt_task_prompts(split=split)[:left]
        else:
            messages = corpus.prompts_from_jsonl(part)[:left]
            pairs += [(f"{Path(part).name}:{i}", m) for i, m in enumerate(messages)]
    if not pairs:
        raise SpecdraftError(f"no prompts from {spec!r}")
    return pairs
