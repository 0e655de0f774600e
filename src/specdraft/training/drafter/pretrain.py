"""Stage 1 of draft training (Goel et al. 2024, arXiv 2403.00858): pretrain a small drafter from scratch
with next-token cross-entropy on text tokenised by the target's tokenizer.

The corpus is a named source (``sharegpt``: assistant turns of the ShareGPT *train* split, so held-out chat
prompts never leak in) or a local text / JSON Lines path. Every ``heldout_every``-th document is held out
(:func:`specdraft.corpus.holdout_every`, a deterministic slice) for the held-out loss. The result is a
Hugging Face checkpoint folder, ``<out>/model``.
"""

from __future__ import annotations

import math
import os
import shlex
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from specdraft.corpus import (
    NAMED_SOURCES,
    PackedDataset,
    pack_documents,
    sharegpt_path,
    text_source,
    tokenize_documents,
)
from specdraft.errors import SpecdraftError
from specdraft.models.registry import load_model, load_tokenizer, resolve
from specdraft.training.drafter.init_drafter import PRESETS, DrafterConfig, init_embeddings_from_target
from specdraft.training.objectives.losses import distillation_loss
from specdraft.training.runs.checkpoint import EXPORT_DTYPES, export_hf, export_path, hardware
from specdraft.training.runs.folders import owns_out, text_source_fingerprint
from specdraft.training.runs.stages import begin_stage, end_stage
from specdraft.training.runs.trainer import (
    TrainerConfig,
    TrainResult,
    check_choices,
    check_ints,
    train,
)


@dataclass(frozen=True, kw_only=True)
class PretrainConfig(TrainerConfig):
    """Settings of ``specdraft pretrain``."""

    target: str = field(metadata={"help": "target model whose tokenizer and vocabulary the drafter shares"})
    source: str = field(default="sharegpt", metadata={"help": "'sharegpt' (train split) or a .txt/.jsonl path"})
    preset: str = field(default="tiny", metadata={"help": f"drafter size: {', '.join(PRESETS)}"})
    num_layers: int | None = field(default=None, metadata={"help": "override the preset's layer count"})
    hidden_size: int | None = field(default=None, metadata={"help": "override the preset's width"})
    num_heads: int | None = field(default=None, metadata={"help": "override the preset's attention heads"})
    num_kv_heads: int | None = field(default=None, metadata={"help": "override the preset's key/value heads"})
    intermediate_size: int | None = field(default=None, metadata={"help": "override the preset's FFN width"})
    seq_len: int = field(default=256, metadata={"help": "tokens per training sequence"})
    tokens: int | None = field(default=None, metadata={"help": "token budget; sets steps when given"})
    heldout_every: int = field(default=50, metadata={"help": "hold out every N-th document for the held-out loss"})
    max_docs: int | None = field(default=None, metadata={"help": "use only the first N documents"})
    max_eval_rows: int = field(default=64, metadata={"help": "held-out sequences per evaluation"})
    init_from_target: bool = field(default=False, metadata={"help": "initialise embeddings from the target's"})
    export_dtype: str = field(default="float32", metadata={"help": "exported weights: float32 or bfloat16"})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.drafter()
        check_ints(self, ("seq_len", "max_eval_rows"), 1)
        for name in ("tokens", "max_docs"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise SpecdraftError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        check_ints(self, ("heldout_every",), 2)
        check_choices(self, ("export_dtype",), EXPORT_DTYPES)

    def drafter(self) -> DrafterConfig:
        return DrafterConfig(preset=self.preset, num_layers=self.num_layers, hidden_size=self.hidden_size,
                             num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                             intermediate_size=self.intermediate_size)

    def with_budget(self, world: int = 1) -> PretrainConfig:
        """This config with ``steps`` set from the token budget (if any)."""
        if self.tokens is None:
            return self
        per_step = self.batch_size * self.seq_len * self.grad_accum * world
        steps = max(1, math.ceil(self.tokens / per_step))
        return replace(self, steps=steps, stop_after=None if self.stop_after is None else min(self.stop_after, steps))


def lm_loss(model, batch, generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """Next-token cross-entropy of a packed batch ``(input_ids, labels)``, each (B, T)."""
    input_ids, labels = batch
    logits = model(input_ids=input_ids, use_cache=False).logits  # (B, T, V)
    return distillation_loss("ce", logits, None, labels), labels.numel()


def heldout_loss(model, rows: torch.Tensor, batch_size: int, bf16: bool) -> dict[str, float]:
    """Mean cross-entropy (and perplexity) over held-out packed rows (N, T + 1)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, rows.shape[0], batch_size):
        chunk = rows[start : start + batch_size].to(device)  # (b, T + 1)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=chunk[:, :-1], use_cache=False).logits  # (b, T, V)
        total += float(distillation_loss("ce", logits, None, chunk[:, 1:])) * chunk[:, 1:].numel()
        count += chunk[:, 1:].numel()
    loss = total / count
    return {"heldout_loss": loss, "heldout_ppl": math.exp(min(loss, 50.0))}


def load_corpus(config: PretrainConfig, tokenizer, world: int = 1) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(train rows (N, T + 1), held-out rows (M, T + 1), number of documents read) of the packed corpus.

    Documents are read and tokenised only until the run has what it needs: ``steps * batch_size * grad_accum *
    world`` training rows and ``max_eval_rows`` held-out rows (every ``heldout_every``-th document is held out); a
    smaller corpus is used whole (and repeated by the epochs of training)."""
    from itertools import islice

    rows = config.steps * config.batch_size * config.grad_accum * world
    need = (rows * config.seq_len + 1, config.max_eval_rows * config.seq_len + 1)  # tokens: train, held out
    docs = islice(text_source(config.source), config.max_docs)
    parts: tuple[list, list] = ([], [])
    have, count = [0, 0], 0
    while have[0] < need[0] or have[1] < need[1] or count < config.heldout_every:
        block = list(islice(docs, 256))
        for ids in tokenize_documents(tokenizer, block):
            side = int(count % config.heldout_every == config.heldout_every - 1)
            parts[side].append(ids)
            have[side] += len(ids) + 1
            count += 1
        if len(block) < 256:
            break
    if count < config.heldout_every:
        raise SpecdraftError(f"source {config.source!r} has {count} documents; need at least "
                             f"heldout_every={config.heldout_every} to hold one out")
    eos = tokenizer.eos_token_id
    train_rows = pack_documents(parts[0], config.seq_len, eos)
    try:
        heldout_rows = pack_documents(parts[1], config.seq_len, eos)
    except SpecdraftError as exc:
        raise SpecdraftError(f"held-out documents (every {config.heldout_every}-th): {exc}; lower heldout_every "
                             "or seq_len") from None
    return train_rows, heldout_rows[: config.max_eval_rows], count


def build_drafter(config: PretrainConfig):
    """A freshly initialised transformers drafter for ``config.target`` (seeded with ``config.seed``)."""
    from transformers import AutoConfig, LlamaForCausalLM

    torch.manual_seed(config.seed)
    model = LlamaForCausalLM(config.drafter().llama_config(AutoConfig.from_pretrained(resolve(config.target))))
    if config.init_from_target:
        target = load_model(config.target, torch.float32, backend="hf").model
        init_embeddings_from_target(model, target.get_input_embeddings().weight)
    return model


def source_inputs(config: PretrainConfig) -> dict[str, tuple[str, str]]:
    """The run's input fingerprint: the content of its text source (:mod:`specdraft.training.runs.folders`)."""
    fingerprint = text_source_fingerprint(config.source, NAMED_SOURCES)
    if config.source == "sharegpt":
        path = sharegpt_path()
        fingerprint += f":{path.stat().st_size}"
    return {"source": (config.source, fingerprint)}


@owns_out
def pretrain(config: PretrainConfig, command: str | None = None) -> Path:
    """Run stage 1 and export the drafter; returns the exported folder ``<out>/model``."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    config = config.with_budget(world)
    plan, run_config = begin_stage("pretrain", config, source_inputs(config), export_path("").name)
    if plan.finished:
        return export_path(config.out)
    config = replace(config, bf16=run_config.bf16)
    tokenizer = load_tokenizer(config.target)
    train_rows, heldout_rows, num_docs = load_corpus(config, tokenizer, world)
    model = build_drafter(config)

    def evaluate(m):
        return heldout_loss(m, heldout_rows, config.batch_size, config.bf16)

    result = train(model, PackedDataset(train_rows), lm_loss, run_config, evaluate=evaluate)
    if int(os.environ.get("RANK", 0)) == 0 and result.steps == config.steps:
        data = (f"`{config.source}`: {num_docs} documents, {train_rows.shape[0]} training sequences of "
                f"{config.seq_len} tokens; every {config.heldout_every}-th document held out")
        export_hf(model.cpu(), export_path(plan.work), config.target, _card(config, result, command, data, model),
                  EXPORT_DTYPES[config.export_dtype])
    end_stage(plan, config, result)
    return export_path(config.out)


def _card(config: PretrainConfig, result: TrainResult, command: str | None, data: str, model) -> dict:
    params = sum(p.numel() for p in model.parameters())
    budget = {"Budget": f"{result.steps} steps, {result.tokens:,} tokens, {result.wall_seconds:.0f} s wall time "
                        f"({result.tokens_per_second:.0f} tokens/s)",
              "Hardware": f"{hardware(config.device)}, {int(os.environ.get('WORLD_SIZE', 1))} process(es)",
              "Parameters": f"{params:,}"}
    return {"title": "specdraft drafter (pretrained)", "command": command or shlex.join(sys.argv), "data": data,
            "budget": budget, "metrics": {"train_loss": result.train_loss} | result.eval, "config": asdict(config)}
