"""Run folders that never lose or mix data: fingerprints of a stage's inputs, shard checksums, and replacing a
run by building the new one beside it.

- **Fingerprints.** A stage records what determines its result: its settings and a content digest of each input
  (a prompts file, the shards of a data folder, a drafter checkpoint). A rerun continues exactly that run or is
  refused with one line naming what changed (:func:`changes`, :func:`refuse_changes`).
- **Shard checksums.** A data folder's ``manifest.json`` lists each shard's record count and, under ``sha256``, its
  checksum. :func:`verify_shards` checks both before a stage reads or reuses the folder, so a shard truncated or
  edited from outside is found.
- **Older layouts are refused**, with one line saying how to convert the folder: a manifest without checksums
  (``tools/add_shard_checksums.py`` adds them), a distill-data run without its prompts fingerprint, a training run
  without ``run.json`` (:func:`older_layout`).
- **One writer.** A stage holds its run folder's lock while it runs (:func:`owns_out`,
  :func:`specdraft.files.owning`): a second writer of the same folder is refused with one line. On the next start of
  a run, what killed writes left in its folder (``.NAME.*.tmp``) is removed (:func:`clear_leftovers`), and a resumed
  training run's logs are cut back to its checkpoint's step (:func:`rewind_log`).
- **Atomic replacement.** ``--overwrite`` builds the new run in ``.<name>.staging`` beside the folder and swaps it
  in at the end (:func:`swap_in`): the old folder is renamed to ``.<name>.old``, the staging folder to the name,
  then the old one is deleted. Killed at any moment, either the old complete run or a resumable new one is left;
  :func:`recover` finishes or undoes an interrupted swap.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from specdraft.errors import SpecdraftError, utf8_error
from specdraft.files import owning, remove_leftovers, write_text_atomic
from specdraft.training.runs.checkpoint import CHECKPOINT_FILE

RUN_FILE = "run.json"
MANIFEST_FILE = "manifest.json"  # of a data folder: shards, their checksums, config, completeness
_CHUNK = 1 << 20


# --- digests ---------------------------------------------------------------------------------------------------------


def count_and_hash(path: str | Path) -> tuple[int, str]:
    """(number of lines, sha256 hex) of a JSON Lines file, in one pass; a last line without its newline counts."""
    digest, lines, last = hashlib.sha256(), 0, b"\n"
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    return lines + (last != b"\n"), digest.hexdigest()


def digest_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    return count_and_hash(path)[1]


def digest_json(value) -> str:
    """sha256 of a JSON-serialisable value in canonical form (sorted keys)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def folder_fingerprint(path: str | Path, pattern: str = "*") -> str:
    """sha256 over the names and contents of the files directly in a folder matching ``pattern`` (a checkpoint
    folder: config, weights, tokenizer), or of one file."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    if not path.is_dir():
        raise SpecdraftError(f"no such file or folder: {path}")
    files = sorted(p for p in path.glob(pattern) if p.is_file() and not p.name.startswith("."))
    return digest_json({p.name: sha256_file(p) for p in files})


def text_source_fingerprint(spec: str, named: Iterable[str] = ()) -> str:
    """Content digest of a pretraining source: a named source by its name and package file, else the file or the
    ``*.txt`` files of a folder (recursive)."""
    if spec in named:
        return f"named:{spec}"
    path = Path(spec)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        return digest_json({str(p.relative_to(path)): sha256_file(p) for p in files})
    if not path.exists():
        raise SpecdraftError(f"no such file or folder: {path}")
    return sha256_file(path)


# --- settings and inputs -------------------------------------------------------------------------------------------


def changes(saved: dict, current: dict, defaults: dict | None = None) -> list[str]:
    """The keys whose values differ, as ``key (old -> new)``. A key the saved record lacks (a setting added since)
    counts as unchanged when the current value is its default."""
    defaults = defaults or {}
    out = []
    for key in sorted(saved.keys() | current.keys()):
        old = saved[key] if key in saved else defaults.get(key, _MISSING)
        new = current.get(key, _MISSING)
        if old != new:
            out.append(f"{key} ({_short(old)} -> {_short(new)})")
    return out


class _Missing:
    def __repr__(self) -> str:
        return "unset"


_MISSING = _Missing()


def _short(value) -> str:
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= 24 else text[:12] + "…" + text[-8:]


def refuse_changes(where: str | Path, what: str, changed: list[str], hint: str) -> None:
    """Raise the one-line refusal naming what changed (nothing when ``changed`` is empty)."""
    if changed:
        raise SpecdraftError(f"{where} holds a {what} made with other inputs or settings: {'; '.join(changed)}; "
                             f"{hint}")


_NOTED: set[str] = set()


def note(message: str) -> None:
    """One line on stderr (a warning that does not stop the run), once per process."""
    if message not in _NOTED:
        _NOTED.add(message)
        print(f"specdraft: note: {message}", file=sys.stderr, flush=True)


# --- shards ----------------------------------------------------------------------------------------------------------


def read_manifest(folder: str | Path) -> dict:
    """A data folder's manifest; a missing or malformed one is a SpecdraftError, and so is one of an older layout
    (shards listed without their checksums: :func:`older_layout`)."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text())
        shards = manifest.get("shards")
        if not isinstance(shards, (dict, list)):
            raise TypeError
    except (OSError, ValueError, TypeError, AttributeError):
        hint = interrupted_hint(folder)
        raise SpecdraftError(f"{folder} is not a distill-data folder (missing or bad {MANIFEST_FILE}){hint}") from None
    sums = manifest.get("sha256")
    if isinstance(shards, list) or not isinstance(sums, dict) or not set(shards) <= set(sums):
        older_layout(folder / MANIFEST_FILE, "lists its shards without their checksums",
                     f"add them with `python tools/add_shard_checksums.py {folder}` (it trusts the shards as they "
                     "are), or make the folder again")
    return manifest


def older_layout(where: str | Path, what: str, how: str) -> None:
    """Refuse a folder or file written in an older layout, in one line: what it lacks and how to convert it."""
    raise SpecdraftError(f"{where} {what} (an older specdraft's layout): {how}")


def shard_entries(folder: Path, names: Iterable[str]) -> tuple[dict[str, int], dict[str, str]]:
    """(records per shard, sha256 per shard) of the named shard files as they are on disk."""
    counts, sums = {}, {}
    for name in names:
        counts[name], sums[name] = count_and_hash(folder / name)
    return counts, sums


def verify_shards(folder: str | Path, manifest: dict, names: Iterable[str] | None = None) -> dict[str, str]:
    """Check that every shard the manifest lists (or ``names`` of them) is on disk with its record count and
    checksum; returns the checksums. A damaged shard raises naming it."""
    folder = Path(folder)
    listed, sums = manifest["shards"], manifest["sha256"]
    names = sorted(listed) if names is None else list(names)
    found = {}
    for name in names:
        path = folder / name
        if not path.is_file():
            raise SpecdraftError(f"{path} is missing but listed in {folder / MANIFEST_FILE}: the folder was changed "
                                 "from outside; rerun the command that made it to regenerate the shard")
        count, digest = count_and_hash(path)
        if count != listed[name] or digest != sums[name]:
            why = (f"{count} records, the manifest says {listed[name]}" if count != listed[name]
                   else "its checksum differs from the manifest's")
            raise SpecdraftError(f"{path} is damaged ({why}): it was truncated or edited outside specdraft; rerun "
                                 "the command that made it to regenerate it")
        found[name] = digest
    return found


def data_fingerprint(folder: str | Path, allow_incomplete: bool = True) -> str:
    """Content digest of a data folder: the checksums of its shards, verified (:func:`verify_shards`)."""
    manifest = read_manifest(folder)
    sums = verify_shards(folder, manifest)
    return digest_json({"shards": sums, "complete": bool(manifest.get("complete"))})


# --- atomic replacement ----------------------------------------------------------------------------------------------


def staging_path(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(f".{out.name}.staging")


def old_path(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(f".{out.name}.old")


def recover(out: str | Path) -> None:
    """Finish or undo a swap that was killed part-way: the old run is put back where the new one is missing, and a
    replaced old run left beside is deleted."""
    out, old = Path(out), old_path(out)
    if not old.exists():
        return
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(old, out)
        note(f"an interrupted replacement of {out} was undone: the previous run is back in place")


def interrupted_hint(folder: Path) -> str:
    if not folder.exists() and old_path(folder).exists():
        return f" (a replacement was interrupted: the previous run is in {old_path(folder)}; rerun the command)"
    return ""


def swap_in(staging: Path, out: Path) -> None:
    """Move a finished ``staging`` folder to ``out``, replacing what is there (see the module docstring)."""
    old = old_path(out)
    if old.exists():
        shutil.rmtree(old)
    if out.exists():
        os.replace(out, old)
    os.replace(staging, out)
    shutil.rmtree(old, ignore_errors=True)


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file beside it (fsynced, then renamed); a file that already holds
    ``text`` is left untouched."""
    try:
        if path.stat().st_size == len(text.encode()) and path.read_text() == text:
            return
    except (OSError, UnicodeDecodeError):
        pass
    write_text_atomic(path, text)


# --- one writer per run folder -------------------------------------------------------------------------------------


def owns_out(stage: Callable) -> Callable:
    """Decorate a stage ``stage(config, ...)`` that writes the run folder ``config.out``: it runs holding the folder's
    lock (:func:`specdraft.files.owning`; under torchrun rank 0 holds it for the run), so a second writer is refused
    with one line before it loads anything."""

    @functools.wraps(stage)
    def run(config, *args, **kwargs):
        if int(os.environ.get("RANK", 0)) != 0:
            return stage(config, *args, **kwargs)
        with owning(config.out, on_stale=note):
            return stage(config, *args, **kwargs)

    return run


def clear_leftovers(folder: str | Path) -> None:
    """Remove what killed writes left in a run folder this process owns (:func:`specdraft.files.remove_leftovers`),
    with a note naming it."""
    removed = remove_leftovers(folder) if Path(folder).is_dir() else []
    if removed:
        note(f"{folder}: removed {len(removed)} temp file(s) left by a killed write ({', '.join(removed[:3])}"
             f"{', ...' if len(removed) > 3 else ''})")


def rewind_log(path: Path, step: int) -> None:
    """Keep the header and the rows of steps up to ``step`` of a run's CSV log (a torn last line is dropped too);
    at step 0, or with no whole header, the log is deleted. Rewritten beside, then renamed."""
    if not path.is_file():
        return
    try:
        with open(path, newline="", encoding="utf-8") as file:  # the rows as written (csv ends them with \r\n)
            text = "" if step == 0 else file.read()
    except UnicodeDecodeError as exc:
        raise SpecdraftError(f"{path} is damaged ({utf8_error(exc)}); move it aside to resume") from None
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):  # a row cut short by a kill
        lines.pop()
    if not lines:
        path.unlink()
        return
    header = lines[0].rstrip("\r\n").split(",")
    column = header.index("step") if "step" in header else 0

    def logged(line: str) -> int:  # the row's step (numbers only: no quoting in these logs); -1 if unreadable
        cells = line.split(",")
        return int(cells[column]) if len(cells) > column and cells[column].isdigit() else -1

    kept = lines[:1] + [line for line in lines[1:] if 0 <= logged(line) <= step]
    if "".join(kept) != text:
        write_text_atomic(path, "".join(kept))


# --- training runs ---------------------------------------------------------------------------------------------------

# Settings that never change a training run's weights: how it is watched, saved, evaluated and exported, and the
# device it runs on (another device rounds differently but trains the same run: it may resume there).
OPERATIONAL = frozenset({
    "out", "resume", "overwrite", "stop_after", "progress", "log_every", "checkpoint_every", "eval_every",
    "eval_prompts", "eval_max_new_tokens", "eval_num_draft_tokens", "max_eval_rows", "export_dtype",
    "allow_incomplete", "device", "eval_data", "threads",
})


def training_settings(config: dict) -> dict:
    """The settings of a training config (as a dict) that determine its weights."""
    return {k: v for k, v in config.items() if k not in OPERATIONAL}


@dataclass(frozen=True)
class RunPlan:
    """Where a training stage writes (``work``: the run folder, or a staging folder beside it under
    ``--overwrite``), whether it resumes a checkpoint there, and whether the run is already finished."""

    out: Path
    work: Path
    resume: bool
    finished: bool
    record: dict
    held: dict | None = None  # the record of the run it continues (``run.json``), read before it is rewritten


def _held_run(folder: Path, export: str, overwrite: bool = False) -> dict | None:
    """The record of the run a folder holds (``run.json``), or None when it holds no run. A run of an older layout
    (a checkpoint, an export or a log, no ``run.json``) is refused, unless it is being replaced (``overwrite``:
    then it counts as a run of unknown settings)."""
    path = folder / RUN_FILE
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except ValueError:
            raise SpecdraftError(f"{path} is damaged; pass --overwrite to replace the run") from None
    if any((folder / name).exists() for name in (CHECKPOINT_FILE, export, "train_log.csv")):
        if overwrite:
            return {}
        older_layout(folder, f"holds a training run without {RUN_FILE}",
                     f"its {export}/ folder loads as it is; to train it again, pass --overwrite")
    return None


def _run_changes(held: dict, record: dict, defaults: dict) -> list[str]:
    changed = changes(held["settings"], record["settings"], defaults)
    for name, digest in record["inputs"].items():
        if held.get("inputs", {}).get(name) != digest:
            changed.append(f"{name} ({record['sources'].get(name, name)}: content differs)")
    return changed


def _state(held: dict) -> str:
    return "finished" if held.get("finished") else "interrupted"


def plan_run(stage: str, config, inputs: dict[str, tuple[str, str]], export: str, defaults: dict) -> RunPlan:
    """Decide where and how a training stage runs (read-only; every process calls it).

    Args:
        stage: the subcommand name, for messages.
        config: the stage's config (a dataclass with ``out``, ``resume``, ``overwrite``; auto values resolved).
        inputs: name -> (what it is, e.g. the path; its content digest).
        export: the exported model's folder name inside the run folder.
        defaults: the config's field defaults (a setting added since a run was made counts at its default).
    """
    from dataclasses import asdict

    out = Path(config.out)
    settings = training_settings(_plain(asdict(config)))
    record = {"stage": stage, "settings": settings, "inputs": {k: v[1] for k, v in inputs.items()},
              "sources": {k: v[0] for k, v in inputs.items()}}
    held = _held_run(out, export, config.overwrite)
    hint = "pass --overwrite to replace it, or use another --out"
    if config.overwrite and held is not None:
        work = staging_path(out)
        staged = _held_run(work, export, overwrite=True) if work.is_dir() else None
        same = bool(staged) and not _run_changes(staged, record, defaults)
        return RunPlan(out, work, same and (work / CHECKPOINT_FILE).is_file(), False, record | {"fresh": not same},
                       staged if same else None)
    if held is None:
        if config.resume:
            raise SpecdraftError(f"nothing to resume: {out} holds no {stage} run (no training checkpoint)")
        return RunPlan(out, out, False, False, record | {"fresh": True})
    if not config.resume:
        raise SpecdraftError(f"{out} holds a {stage} run ({_state(held)}); pass --resume to continue it, or "
                             "--overwrite to replace it")
    refuse_changes(out, f"{stage} run", _run_changes(held, record, defaults), hint)
    finished = _state(held) == "finished"
    return RunPlan(out, out, (out / CHECKPOINT_FILE).is_file(), finished, record | {"fresh": False}, held)


def stage_changes(config, inputs: dict[str, tuple[str, str]], export: str, defaults: dict,
                  overwrite: bool = False) -> list[str] | None:
    """What differs between the run in ``config.out`` and this config and inputs (None when it holds no run). A
    run of an older layout is refused, or with ``overwrite`` (it is about to be replaced) differs in everything."""
    from dataclasses import asdict

    recover(config.out)
    held = _held_run(Path(config.out), export, overwrite)
    if held is None:
        return None
    if not held:
        return [f"{RUN_FILE} (an older layout)"]
    record = {"settings": training_settings(_plain(asdict(config))), "inputs": {k: v[1] for k, v in inputs.items()},
              "sources": {k: v[0] for k, v in inputs.items()}}
    return _run_changes(held, record, defaults)


def start_run(plan: RunPlan, precision: dict, device: dict | None = None, arithmetic: dict | None = None) -> None:
    """Prepare the working folder (rank 0 only): a fresh staging folder is emptied, what killed writes left is
    removed, and ``run.json`` written (with the precision, the device and the arithmetic of this session of the run:
    a resumed run records where it continued)."""
    if plan.record["fresh"] and plan.work != plan.out and plan.work.exists():
        shutil.rmtree(plan.work)
    plan.work.mkdir(parents=True, exist_ok=True)
    clear_leftovers(plan.work)
    record = {k: v for k, v in plan.record.items() if k != "fresh"} | {"precision": precision, "finished": False}
    record |= {"device": device} if device is not None else {}
    record |= {"arithmetic": arithmetic} if arithmetic is not None else {}
    atomic_write(plan.work / RUN_FILE, json.dumps(record, indent=1))


def arithmetic_record(threads: int) -> dict:
    """What a CPU run's rounding depends on besides its settings: the CPU, the kernel level torch dispatches to, the
    torch build and the intra-op thread count (kernels split their work, and so their sums, by thread)."""
    from specdraft.hardware import cpu_identity

    return {"cpu": cpu_identity(), "isa": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "threads": threads}


def resumed_threads(plan: RunPlan, asked: int | None) -> int:
    """The thread count a stage trains with: ``asked`` if given, else the count the run it resumes recorded, else
    this process's current count."""
    if asked is not None:
        return asked
    held = (plan.held or {}).get("arithmetic", {}).get("threads") if plan.resume else None
    return int(held) if held else torch.get_num_threads()


def arithmetic_changes(plan: RunPlan, current: dict) -> list[str]:
    """How this session's arithmetic differs from the one the resumed run's checkpoint was made with."""
    held = (plan.held or {}).get("arithmetic") if plan.resume else None
    if not held:
        return []
    return [f"{key} {held.get(key)!r} -> {current[key]!r}" for key in current if held.get(key) != current[key]]


def finish_run(plan: RunPlan) -> None:
    """Mark the run finished and, under ``--overwrite``, swap it in (rank 0 only, after the export)."""
    path = plan.work / RUN_FILE
    record = json.loads(path.read_text())
    atomic_write(path, json.dumps(record | {"finished": True}, indent=1))
    if plan.work != plan.out:
        swap_in(plan.work, plan.out)


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
