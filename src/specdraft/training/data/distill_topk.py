"""Teacher annotation: the target's top-k log-probabilities for every response token of a distill-data folder,
computed once by teacher forcing, so that several fine-tuning runs (one per loss, Goel et al. 2024, Table 1) share
one pass of the target instead of each running it on every batch.

Input: a ``distill-data`` folder (finished, or unfinished with ``allow_incomplete``). Output: a folder of the same
shard names whose records gain ``top_ids`` / ``top_logprobs`` (R, k), plus a manifest; ``finetune
--use-stored-topk`` reads it. Shards are written atomically and skipped when present, so a killed run resumes. The
manifest records each output shard's checksum and the checksum of the source shard it annotates: a rerun on
changed data or with other settings is refused, ``overwrite`` rebuilds the folder beside the old one and swaps it
in when complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from specdraft.corpus import read_jsonl
from specdraft.errors import SpecdraftError
from specdraft.hardware import check_device_name, resolve_device, resolve_dtype
from specdraft.models.registry import load_model, load_tokenizer, parse_dtype
from specdraft.training.data.records import load_distill_records
from specdraft.training.data.scoring import score_records
from specdraft.training.runs import folders
from specdraft.training.runs.folders import MANIFEST_FILE, atomic_write, count_and_hash, owns_out


@dataclass(frozen=True)
class TeacherTopkConfig:
    """Settings of ``specdraft distill-topk``."""

    data: str = field(metadata={"help": "distill-data folder to annotate"})
    out: str = field(metadata={"help": "output folder (same shards, with top-k log-probs)"})
    target: str = field(metadata={"help": "target model (built-in name, folder or cached hub id)"})
    k: int = field(default=32, metadata={"help": "log-probabilities kept per response token"})
    batch_size: int = field(default=8, metadata={"help": "sequences per target forward"})
    dtype: str = field(default="auto", metadata={"help": "target weights: auto (bfloat16 where the machine has "
                                                          "native bf16, else float32), float32 or bfloat16"})
    allow_incomplete: bool = field(default=False, metadata={"help": "annotate an unfinished distill-data folder"})
    overwrite: bool = field(default=False, metadata={"help": "replace a run in --out made from other data or "
                                                             "settings (built beside it, swapped in when complete)"})
    device: str = field(default="auto", metadata={"help": "where the target runs: auto (CUDA when visible, else the "
                                                          "CPU), cpu, cuda or cuda:N; not part of the fingerprint"})

    def __post_init__(self) -> None:
        if self.k < 1 or self.batch_size < 1:
            raise SpecdraftError(f"k and batch_size must be >= 1, got {self.k}, {self.batch_size}")
        if Path(self.data).resolve() == Path(self.out).resolve():
            raise SpecdraftError("distill-topk writes a new folder: --out must differ from --data")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise SpecdraftError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        try:
            check_device_name(self.device)
        except ValueError as exc:
            raise SpecdraftError(str(exc)) from None


def annotate_shard(model, records: list[dict], config: TeacherTopkConfig, pad_id: int) -> list[dict]:
    """Records with ``top_ids`` / ``top_logprobs`` added, batched by length."""
    out = [dict(r) for r in records]
    score_records(model, out, config.k, pad_id, config.batch_size)
    return out


@owns_out
def annotate_topk(config: TeacherTopkConfig, progress: bool = True) -> dict:
    """Annotate every shard of ``config.data`` into ``config.out``; returns the output manifest."""
    from tqdm import tqdm

    try:
        device = resolve_device(config.device)
        choice = resolve_dtype(config.dtype, device.device)
    except ValueError as exc:
        raise SpecdraftError(str(exc)) from None
    config = replace(config, dtype=choice.dtype, device=device.name)
    load_distill_records(config.data, config.allow_incomplete)  # checks the folder, its shards and every record
    source = folders.read_manifest(config.data)
    source_sums = folders.verify_shards(config.data, source)
    out = Path(config.out)
    folders.recover(out)
    work = folders.staging_path(out) if config.overwrite and out.exists() else out
    settings = {k: v for k, v in asdict(config).items() if k in ("target", "k", "dtype")}
    entries = _check_out_folder(work, settings, source_sums, Path(config.data), replace_ok=work != out)
    work.mkdir(parents=True, exist_ok=True)
    folders.clear_leftovers(work)
    todo = [name for name in sorted(source["shards"]) if name not in entries]
    model = tokenizer = None
    bar = tqdm(total=len(source["shards"]), initial=len(entries), unit="shard", desc="distill-topk",
               disable=not progress)
    for name in todo:
        if model is None:
            model = load_model(config.target, parse_dtype(config.dtype), backend="hf", device=config.device).model
            tokenizer = load_tokenizer(config.target)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        started = time.perf_counter()
        records = annotate_shard(model, read_jsonl(Path(config.data) / name), config, pad_id)
        text = "".join(json.dumps(r) + "\n" for r in records)
        folders.atomic_write(work / name, text)
        entries[name] = (len(records), folders.digest_bytes(text.encode()), source_sums[name])
        _write_manifest(work, source, entries, settings, choice.to_dict(), device.to_dict())
        tokens = sum(len(r["response_token_ids"]) for r in records)
        bar.update(1)
        bar.set_postfix(response_tokens_per_s=f"{tokens / (time.perf_counter() - started):.0f}")
    bar.close()
    manifest = _write_manifest(work, source, entries, settings, choice.to_dict(), device.to_dict())
    if work != out and manifest["complete"]:
        folders.swap_in(work, out)
    return manifest


def _check_out_folder(out: Path, settings: dict, source_sums: dict[str, str], data: Path,
                      replace_ok: bool) -> dict[str, tuple[int, str, str]]:
    """(records, sha256, source sha256) of the output shards that can be kept; a run of other settings or on other
    source shards is refused (or, in a staging folder, discarded); a damaged shard is set aside and redone."""
    import shutil

    if not out.is_dir():
        return {}
    manifest = {}
    with contextlib.suppress(OSError, ValueError):
        manifest = json.loads((out / MANIFEST_FILE).read_text())
    saved = {k: v for k, v in (manifest.get("teacher") or {}).items() if k in settings}
    changed = folders.changes(saved, settings) if saved else []
    made_from = manifest.get("source_sha256") or {}
    changed += [f"{name} of {data} (its content changed)" for name in sorted(made_from)
                if name in source_sums and made_from[name] != source_sums[name]]
    if changed and replace_ok:
        shutil.rmtree(out)
        return {}
    folders.refuse_changes(out, "distill-topk run", changed, "use a new --out, or --overwrite to replace it")
    sums, entries = manifest.get("sha256") or {}, {}
    for path in sorted(out.glob("shard-*.jsonl")):
        count, digest = folders.count_and_hash(path)
        expected = _source_count(data, path.name)
        known = path.name in sums or _annotates(path, data / path.name)
        if path.name not in source_sums or not known:
            folders.refuse_changes(out, "distill-topk run", [f"{path.name} (not an annotation of {data})"],
                                "use a new --out, or --overwrite to replace it")
        if count != expected or sums.get(path.name, digest) != digest:
            os.replace(path, path.with_name(path.name + ".damaged"))
            folders.note(f"{path} was damaged ({count} records of {expected}, or a changed checksum): kept as "
                      f"{path.name}.damaged and annotated again")
            continue
        entries[path.name] = (count, digest, source_sums[path.name])
    return entries


def _source_count(data: Path, name: str) -> int:
    return count_and_hash(data / name)[0] if (data / name).is_file() else -1


def _annotates(path: Path, source: Path) -> bool:
    """Whether the first record of an output shard is the first record of ``source`` plus its top-k (a shard
    written just before a kill, which the manifest does not list yet)."""
    try:
        with open(path) as mine, open(source) as theirs:
            record, original = json.loads(mine.readline()), json.loads(theirs.readline())
    except (OSError, ValueError):
        return False
    return {k: v for k, v in record.items() if k not in ("top_ids", "top_logprobs")} == {
        k: v for k, v in original.items() if k not in ("top_ids", "top_logprobs")}


def _write_manifest(out: Path, source: dict, entries: dict, settings: dict, dtype_choice: dict,
                    device_choice: dict) -> dict:
    names = sorted(entries)
    manifest = {"num_shards": source["num_shards"],
                "complete": bool(source.get("complete")) and len(names) == len(source["shards"]),
                "shards": {n: entries[n][0] for n in names}, "sha256": {n: entries[n][1] for n in names},
                "source_sha256": {n: entries[n][2] for n in names}, "records": sum(entries[n][0] for n in names),
                "config": {**source.get("config", {}), "top_logprobs": settings["k"]},
                "teacher": settings | {"dtype_choice": dtype_choice, "device_choice": device_choice}}
    atomic_write(out / MANIFEST_FILE, json.dumps(manifest, indent=1))
    return manifest
