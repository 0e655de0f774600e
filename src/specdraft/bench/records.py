"""Answer records on disk: one JSON line per answer in ``OUT/answers/<method>.jsonl`` and ``OUT/run.json``.

Records follow Spec-Bench's model_answer files (``question_id``, ``category``, ``answer_id``, ``model_id``,
``tstamp``, ``choices: [{"index", "turns", "new_tokens", "wall_time", "accept_lengths", "decoding_steps"}]``) plus
our fields: ``subtask``, ``method`` (the name before a sweep suffix), ``repeat``, ``num_draft_tokens``,
``param_ratio``, ``engine`` (the build of another program that answered, e.g. llama.cpp's commit, options, AMX and
weight repacking; null for specdraft's and transformers' methods), and in the choice, per turn: ``token_ids``,
``finish_reason``, ``draft_seconds``, ``verify_seconds``, ``prefill_seconds``, ``draft_tokens_proposed``,
``draft_tokens_accepted``, ``accepted_per_position``, ``reached_per_position``, ``draft_length_counts`` (steps that
verified 0, 1, 2, ... draft tokens), and ``engine_counters`` (another engine's own counters, e.g. vLLM's
speculative-decoding metrics). A per-turn list is null when the method cannot
measure that quantity.

Each record is appended and flushed on its own, so an interrupted run keeps what it finished; a last line cut by a
kill is dropped on reading (and cut off the file before appending again).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from specdraft.bench.methods import Method, TurnResult
from specdraft.bench.questions import Question
from specdraft.errors import SpecdraftError, json_error

ANSWERS_DIR = "answers"
RUN_FILE = "run.json"
REPORT_FILES = ("summary.json", "summary.md", "speedup_by_subtask.png", "accept_lengths.png",
                "block_efficiency_vs_num_draft_tokens.png")
PER_TURN = ("finish_reason", "draft_seconds", "verify_seconds", "prefill_seconds", "draft_tokens_proposed",
            "draft_tokens_accepted", "accepted_per_position", "reached_per_position", "draft_length_counts",
            "engine_counters")


def method_filename(name: str) -> str:
    """A file name for a method name: unsafe characters become ``_`` and then a short hash keeps names distinct."""
    safe = re.sub(r"[^A-Za-z0-9._=-]+", "_", name.replace("γ", "k")).strip("_.") or "method"
    if safe != name:
        safe = f"{safe[:80]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
    return f"{safe}.jsonl"


def _per_turn(turns: Sequence[TurnResult], key: str) -> list | None:
    values = [getattr(t, key) for t in turns]
    return None if any(v is None for v in values) else values


def make_record(question: Question, method: Method, repeat: int, turns: Sequence[TurnResult],
                texts: Sequence[str]) -> dict:
    """The JSON record of one answer (all turns of one question by one method)."""
    steps = _per_turn(turns, "decoding_steps")
    accept = _per_turn(turns, "accept_lengths")
    flat = None if accept is None else [n for per_turn in accept for n in per_turn]  # Spec-Bench: one list
    choice = {
        "index": 0, "turns": list(texts), "new_tokens": [len(t.token_ids) for t in turns],
        "wall_time": [t.wall_time for t in turns], "accept_lengths": flat,
        "decoding_steps": steps, "token_ids": [t.token_ids for t in turns],
    }
    choice |= {key: _per_turn(turns, key) for key in PER_TURN}
    return {
        "question_id": question.question_id, "category": question.category, "subtask": question.subtask,
        "answer_id": uuid.uuid4().hex, "model_id": method.name, "tstamp": time.time(), "method": method.base,
        "repeat": repeat, "num_draft_tokens": method.num_draft_tokens, "param_ratio": method.param_ratio,
        "engine": method.engine, "choices": [choice],
    }


def record_key(record: dict) -> tuple:
    """What makes an answer unique in a run: (question_id, model_id, repeat)."""
    return record["question_id"], record["model_id"], record.get("repeat", 0)


def append_record(path: Path, record: dict) -> None:
    """Append one line and flush it to the OS (one write, so a kill leaves at most one cut last line)."""
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()


def read_records(path: Path, repair: bool = False) -> list[dict]:
    """Records of one answers file. A cut last line is ignored; with ``repair`` it is also cut off the file (and a
    complete last line missing its newline gets one) so that appending continues cleanly. A bad line elsewhere is
    an error naming the file and line."""
    data = path.read_bytes()
    lines = data.split(b"\n")
    records, good_end = [], 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            good_end += len(line) + 1
            continue
        try:
            records.append(json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError):
            if number == len(lines):  # the unterminated tail: a write cut short
                break
            raise SpecdraftError(f"{path}, line {number}: corrupt answer record (not a cut last line)") from None
        good_end += len(line) + 1
    if repair:
        _repair(path, data, good_end)
    return records


def _repair(path: Path, data: bytes, good_end: int) -> None:
    good_end = min(good_end, len(data))
    if good_end < len(data):
        with path.open("r+b") as f:
            f.truncate(good_end)
    elif data and not data.endswith(b"\n"):
        with path.open("ab") as f:
            f.write(b"\n")


def load_answers(out: Path, repair: bool = False) -> list[dict]:
    """Every record under ``out/answers`` (file order, then line order)."""
    folder = Path(out) / ANSWERS_DIR
    if not folder.is_dir():
        return []
    return [r for path in sorted(folder.glob("*.jsonl")) for r in read_records(path, repair)]


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def check_out(out: Path, run_info: dict, overwrite: bool) -> None:
    """Raise SpecdraftError when ``out`` holds a run whose ``config`` or ``questions_sha256`` differ from
    ``run_info``'s, unless ``overwrite``. Reads only: call it before loading models."""
    if Path(out).exists() and not Path(out).is_dir():
        raise SpecdraftError(f"--out must be a folder, {out} is a file")
    run_file, answers = Path(out) / RUN_FILE, Path(out) / ANSWERS_DIR
    has_answers = answers.is_dir() and any(answers.glob("*.jsonl"))
    if not overwrite and (run_file.is_file() or has_answers):
        _check_same_run(run_file, run_info)


def prepare_out(out: Path, run_info: dict, overwrite: bool) -> None:
    """Make ``out`` ready for the run described by ``run_info`` and write it as run.json.

    A folder holding the same run is resumed; another run is an error (:func:`check_out`) unless ``overwrite``,
    which deletes its answers and report (nothing else in the folder).
    """
    check_out(out, run_info, overwrite)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    answers = out / ANSWERS_DIR
    if overwrite:
        for path in [*answers.glob("*.jsonl"), *(out / n for n in REPORT_FILES)]:
            path.unlink(missing_ok=True)
    answers.mkdir(exist_ok=True)
    (out / RUN_FILE).write_text(json.dumps(run_info, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _check_same_run(run_file: Path, run_info: dict) -> None:
    if not run_file.is_file():
        raise SpecdraftError(f"{run_file.parent} has answers but no {RUN_FILE}; use --overwrite to start over")
    old = read_run_info(run_file.parent)
    mine = {**run_info["config"], "questions_sha256": run_info["questions_sha256"]}
    theirs = {**old.get("config", {}), "questions_sha256": old.get("questions_sha256")}
    differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    if differ:
        detail = "; ".join(f"{k}: {theirs.get(k)!r} -> {mine.get(k)!r}" for k in differ)
        raise SpecdraftError(f"{run_file.parent} holds a run with a different config ({detail}); "
                             "use --overwrite to discard it, or another --out")


def read_run_info(out: Path) -> dict:
    """The run.json of ``out``; SpecdraftError when missing or unreadable."""
    path = Path(out) / RUN_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecdraftError(f"no benchmark run in {out} (missing {RUN_FILE})") from None
    except json.JSONDecodeError as exc:
        raise SpecdraftError(f"{path} is not valid JSON ({json_error(exc)})") from None
