"""Teacher annotation: the target's top-k log-probabilities for every response token of a distill-data folder,
computed once by teacher forcing, so that several fine-tuning runs (one per loss, Goel et al. 2024, Table 1) share
one pass of the target instead of each running it on every batch.

Input: a ``distill-data`` folder (finished, or unfinished with ``allow_incomplete``). Output: a folder of the same
shard names whose records gain ``top_ids`` / ``top_logprobs`` (R, k), plus a manifest; ``finetune
--use-stored-topk`` reads it. Shards are written atomically and skipped when present, so a killed run resumes.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdraft.errors import SpecdraftError
from specdraft.training.scoring import score_records


@dataclass(frozen=True)
class TeacherTopkConfig:
    """Settings of ``specdraft distill-topk``."""

    data: str = field(metadata={"help": "distill-data folder to annotate"})
    out: str = field(metadata={"help": "output folder (same shards, with top-k log-probs)"})
    target: str = field(metadata={"help": "target model (built-in name, folder or cached hub id)"})
    k: int = field(default=32, metadata={"help": "log-probabilities kept per response token"})
    batch_size: int = field(default=8, metadata={"help": "sequences per target forward"})
    dtype: str = field(default="bfloat16", metadata={"help": "target weights: float32 or bfloat16"})
    allow_incomplete: bool = field(default=False, metadata={"help": "annotate an unfinished distill-data folder"})

    def __post_init__(self) -> None:
        if self.k < 1 or self.batch_size < 1:
            raise SpecdraftError(f"k and batch_size must be >= 1, got {self.k}, {self.batch_size}")
        if Path(self.data).resolve() == Path(self.out).resolve():
            raise SpecdraftError("distill-topk writes a new folder: --out must differ from --data")


def annotate_shard(model, records: list[dict], config: TeacherTopkConfig, pad_id: int) -> list[dict]:
    """Records with ``top_ids`` / ``top_logprobs`` added, batched by length."""
    out = [dict(r) for r in records]
    score_records(model, out, config.k, pad_id, config.batch_size)
    return out


def annotate_topk(config: TeacherTopkConfig, progress: bool = True) -> dict:
    """Annotate every shard of ``config.data`` into ``config.out``; returns the output manifest."""
    from tqdm import tqdm

    from specdraft.files import write_text_atomic as _atomic_write
    from specdraft.models.registry import load_model, load_tokenizer, parse_dtype
    from specdraft.training.data import MANIFEST_FILE, read_jsonl
    from specdraft.training.finetune import load_distill_records

    load_distill_records(config.data, config.allow_incomplete)  # checks the folder and every record
    source = json.loads((Path(config.data) / MANIFEST_FILE).read_text())
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(".*.tmp"):
        stale.unlink()
    model = load_model(config.target, parse_dtype(config.dtype), backend="hf").model
    tokenizer = load_tokenizer(config.target)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    shards = sorted(source["shards"])
    bar = tqdm(shards, unit="shard", desc="distill-topk", disable=not progress)
    for name in bar:
        if (out / name).is_file():
            continue
        started = time.perf_counter()
        records = annotate_shard(model, read_jsonl(Path(config.data) / name), config, pad_id)
        _atomic_write(out / name, "".join(json.dumps(r) + "\n" for r in records))
        tokens = sum(len(r["response_token_ids"]) for r in records)
        bar.set_postfix(response_tokens_per_s=f"{tokens / (time.perf_counter() - started):.0f}")
    present = {name: source["shards"][name] for name in shards if (out / name).is_file()}
    manifest = {"num_shards": source["num_shards"], "complete": source.get("complete", False)
                and len(present) == len(shards), "shards": present, "records": sum(present.values()),
                "config": {**source.get("config", {}), "top_logprobs": config.k},
                "teacher": {k: v for k, v in asdict(config).items() if k not in ("out",)}}
    _atomic_write(out / MANIFEST_FILE, json.dumps(manifest, indent=1))
    return manifest
