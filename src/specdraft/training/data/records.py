"""The records of ``specdraft distill-data`` folders as the training stages read them (Goel et al. 2024, arXiv
2403.00858, stage 2): each a prompt and the target's response as token ids, with the response's top-k
log-probabilities when stored. Loading checks every shard against its manifest and every record; the split holds
out whole prompts, so no held-out prompt is ever trained on.
"""

from __future__ import annotations

import json
from pathlib import Path

from specdraft.corpus import holdout_every, read_jsonl
from specdraft.errors import SpecdraftError
from specdraft.training.runs.folders import read_manifest, verify_shards


def data_folders(spec: str) -> list[str]:
    """The folders of ``--data``: one, or several separated by commas (each named once)."""
    folders = list(dict.fromkeys(part.strip() for part in spec.split(",") if part.strip()))
    if not folders:
        raise SpecdraftError(f"--data names no folder: {spec!r}")
    return folders


def load_distill_records(folder: str | Path, allow_incomplete: bool = False, need_topk: bool = False) -> list[dict]:
    """The records of a distill-data folder, checked: every shard's record count and checksum against the manifest
    (:func:`specdraft.training.runs.folders.verify_shards`), then every record; an unfinished folder is refused unless
    ``allow_incomplete``."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    shards = sorted(manifest["shards"])
    if not manifest.get("complete") and not allow_incomplete:
        raise SpecdraftError(f"{folder} is incomplete ({len(shards)} of {manifest.get('num_shards')} shards): "
                             "finish distill-data or pass --allow-incomplete")
    verify_shards(folder, manifest, shards)
    records = [record for name in shards for record in read_jsonl(folder / name)]
    for number, record in enumerate(records):
        _check_record(record, f"{folder} record {number}", need_topk)
    if not records:
        raise SpecdraftError(f"{folder} holds no records")
    return records


def _check_record(record: dict, where: str, need_topk: bool) -> None:
    for key in ("prompt_token_ids", "response_token_ids"):
        ids = record.get(key)
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise SpecdraftError(f"{where}: {key!r} must be a non-empty list of token ids")
    if need_topk and ("top_ids" not in record or "top_logprobs" not in record):
        raise SpecdraftError(f"{where}: no stored top-k ('top_ids', 'top_logprobs'); make the data with "
                             "--top-logprobs K or drop --use-stored-topk")


def split_by_prompt(records: list[dict], every: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out) records: every ``every``-th distinct prompt, with all its responses, is held out."""
    ids = list(dict.fromkeys(r.get("prompt_id", json.dumps(r["prompt_token_ids"])) for r in records))
    if len(ids) < every:
        raise SpecdraftError(f"only {len(ids)} distinct prompts; heldout_every={every} would hold none out")
    heldout = set(holdout_every(ids, every)[1])
    train = [r for r in records if r.get("prompt_id", json.dumps(r["prompt_token_ids"])) not in heldout]
    return train, [r for r in records if r.get("prompt_id", json.dumps(r["prompt_token_ids"])) in heldout]


def greedy_answers(folder: str) -> tuple[list[dict], bool]:
    """The records of a distill-data folder, and whether they are the target's greedy answers (exact τ applies)."""
    records = load_distill_records(folder, allow_incomplete=True)
    path = Path(folder) / "distill_config.json"
    setup = json.loads(path.read_text()) if path.is_file() else {}
    return records, setup.get("temperature") == 0 and setup.get("policy", "target") == "target"


def check_token_ids(records: list[dict], vocab_size: int, where: str) -> None:
    top = max(max(r["prompt_token_ids"] + r["response_token_ids"]) for r in records)
    if top >= vocab_size:
        raise SpecdraftError(f"{where} holds token id {top}, outside the target's vocabulary of {vocab_size}: "
                             "was it made with another target?")

