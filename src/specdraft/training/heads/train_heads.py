"""``specdraft train-heads``: train self-drafting heads (Medusa-1, Cai et al. 2024, arXiv 2401.10774; EAGLE, Li et
al. 2024, arXiv 2401.15077; EAGLE-3; DFlash, arXiv 2602.06036) on a frozen target's features.

The data is a distill-data folder (the target's own responses to prompts, :mod:`specdraft.training.data.distill_data`),
so the heads learn the target's continuations. Teacher features (the target's final-normed hidden states, the LM
head's input) are computed on the fly by the frozen transformers target under ``torch.no_grad()``; only the heads
get gradients. The generic trainer (:func:`specdraft.training.runs.trainer.train`) gives the schedule, bf16 autocast,
progress, checkpoints and exact resume. Evaluation reports each kind's held-out metrics and, when the kind has a
drafter, the block efficiency τ of greedy speculative decoding on held-out prompts.

A kind registers here in :data:`HEAD_KINDS` (name -> :class:`~specdraft.training.heads.kinds.HeadKind`). The trained
heads are exported to ``<out>/heads`` (:func:`specdraft.heads.save_heads`) with the token ranking of the training
responses (:mod:`specdraft.draft_vocab`, for drafting with a reduced vocabulary).
"""

from __future__ import annotations

import copy
import os
import shlex
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from specdraft.draft_vocab import rank_tokens
from specdraft.drafters.options import parse_options
from specdraft.errors import SpecdraftError
from specdraft.heads import load_heads, save_heads
from specdraft.models.registry import eos_token_ids
from specdraft.training.data.batches import DistillDataset, collate_distill
from specdraft.training.data.records import check_token_ids, load_distill_records, split_by_prompt
from specdraft.training.heads.dflash import DFLASH
from specdraft.training.heads.eagle3 import EAGLE3
from specdraft.training.heads.glide import GLIDE
from specdraft.training.heads.kinds import EAGLE, MEDUSA, HeadKind
from specdraft.training.objectives.losses import loss_names
from specdraft.training.runs.checkpoint import EXPORT_DTYPES, hardware, model_card
from specdraft.training.runs.folders import owns_out
from specdraft.training.runs.stages import begin_stage, data_inputs, end_stage
from specdraft.training.runs.trainer import (
    TrainerConfig,
    TrainResult,
    check_choices,
    check_ints,
    init_distributed,
    train,
)

HEAD_KINDS: dict[str, HeadKind] = {
    "medusa": MEDUSA,
    "eagle": EAGLE,
    "eagle3": EAGLE3,
    "glide": GLIDE,
    "dflash": DFLASH,
}

HEADS_FOLDER = "heads"


def get_kind(name: str) -> HeadKind:
    """The registered kind ``name`` (a clear error naming the known kinds otherwise)."""
    if name not in HEAD_KINDS:
        raise SpecdraftError(f"unknown heads kind {name!r}; known: {', '.join(sorted(HEAD_KINDS))}")
    return HEAD_KINDS[name]


@dataclass(frozen=True, kw_only=True)
class HeadsConfig(TrainerConfig):
    """Settings of ``specdraft train-heads``."""

    kind: str = field(metadata={"help": "heads kind: medusa, eagle, eagle3, glide or dflash"})
    target: str = field(metadata={"help": "target model (built-in name, folder or cached hub id), kept frozen"})
    data: str = field(metadata={"help": "distill-data output folder (the target's responses)"})
    num_heads: int = field(default=4, metadata={"help": "number of heads (medusa: draft depth)"})
    share_lm_head: bool = field(default=True, metadata={"help": "heads reuse the frozen target LM head instead of "
                                                                "their own vocabulary projection (D*D params a head)"})
    options: str = field(default="", metadata={"help": "kind-specific settings, 'k=v;k=v' (medusa: decay=0.8, "
                                                          "distill=0|1; eagle: cls_weight=0.1, reg_weight=1, noise=0; "
                                                          f"eagle3: loss={'|'.join(loss_names(eagle3=True))} "
                                                          "and its settings, ttt_steps=7, decay=0.8, "
                                                          "draft_vocab=8192, aux_layers=2,15,27, align_weight=1; "
                                                          "eagle and eagle3, FSPAD: fspad_sampling=0, "
                                                          "partial_alignment=0; glide: layers=1, glimpse_layer=-1, "
                                                          "ttt_steps=3, decay=0.8; dflash: loss, block_size=8, "
                                                          "blocks=16, gamma=4, draft_vocab=8192, "
                                                          "target_layers=1,8,14,20,27, layers=1, mask_token_id)"})
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate"})
    allow_incomplete: bool = field(default=False, metadata={"help": "train on an unfinished distill-data folder"})
    max_seq_len: int = field(default=512, metadata={"help": "prompt + response tokens kept per example"})
    heldout_every: int = field(default=20, metadata={"help": "hold out every N-th prompt for evaluation"})
    eval_prompts: int = field(default=4, metadata={"help": "held-out prompts decoded for block efficiency"})
    eval_max_new_tokens: int = field(default=32, metadata={"help": "tokens generated per evaluation prompt"})
    eval_num_draft_tokens: int = field(default=4, metadata={"help": "γ (tree depth) of the τ evaluation"})
    target_dtype: str = field(default="float32", metadata={"help": "frozen target weights: float32 or bfloat16"})
    export_dtype: str = field(default="float32", metadata={"help": "dtype of the exported heads' weights"})
    init_heads: str = field(default="", metadata={"help": "start from these heads (a heads folder of the same kind "
                                                          "and architecture) instead of a fresh initialisation"})
    eval_data: str = field(default="", metadata={"help": "evaluate on this distill-data folder instead of the "
                                                         "held-out split (e.g. the target's answers to Spec-Bench)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind not in HEAD_KINDS:
            raise SpecdraftError(f"kind must be one of {', '.join(sorted(HEAD_KINDS))}, got {self.kind!r}")
        check_ints(self, ("num_heads", "max_seq_len", "eval_max_new_tokens", "eval_num_draft_tokens"), 1)
        check_ints(self, ("eval_prompts",), 0)
        check_ints(self, ("heldout_every",), 2)
        check_choices(self, ("target_dtype", "export_dtype"), EXPORT_DTYPES)
        parse_options(self.options)

    def kind_options(self) -> dict[str, str]:
        """``options`` as a dict."""
        return parse_options(self.options)


# --- evaluation ------------------------------------------------------------------------------------------------------


def heads_block_efficiency(kind: HeadKind, module, target, prompts, config: HeadsConfig, eos: tuple) -> float:
    """τ = new tokens / target forwards of greedy decoding with the kind's drafter over ``prompts``, pooled."""
    from specdraft.decoding import GenerationConfig, generate

    drafter = kind.drafter(copy.deepcopy(module).float().cpu().eval())
    gen = GenerationConfig(max_new_tokens=config.eval_max_new_tokens, num_draft_tokens=config.eval_num_draft_tokens,
                           speculation="fixed",
                           eos_token_ids=tuple(eos))
    new_tokens, forwards = 0, 0
    for prompt in prompts:
        stats = generate(target, list(prompt), drafter, gen).stats
        new_tokens, forwards = new_tokens + stats.new_tokens, forwards + stats.target_forward_calls
    return new_tokens / max(forwards, 1)


def make_evaluate(config: HeadsConfig, kind: HeadKind, target_model, target, heldout: list[dict], pad_id: int,
                  eos: tuple):
    """evaluate(module) for the trainer: the kind's pooled held-out metrics and, if it drafts, τ."""
    heldout = load_distill_records(config.eval_data, allow_incomplete=True) if config.eval_data else heldout
    dataset = DistillDataset(heldout, config.max_seq_len)
    batches = [collate_distill([dataset[i] for i in range(s, min(s + config.batch_size, len(dataset)))], pad_id)
               for s in range(0, len(dataset), config.batch_size)]
    prompts = list(dict.fromkeys(tuple(r["prompt_token_ids"]) for r in heldout))[: config.eval_prompts]

    def evaluate(module) -> dict[str, float]:
        device = next(module.parameters()).device
        sums: dict[str, list[float]] = {}
        for batch in batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.bf16):
                for name, (total, count) in kind.metrics(module, target_model, batch).items():
                    pooled = sums.setdefault(name, [0.0, 0])
                    pooled[0], pooled[1] = pooled[0] + total, pooled[1] + count
        metrics = {name: total / max(count, 1) for name, (total, count) in sums.items()}
        if prompts and kind.drafter is not None:
            metrics[f"block_efficiency@{config.eval_num_draft_tokens}"] = heads_block_efficiency(
                kind, module, target, prompts, config, eos)
        return metrics

    return evaluate


# --- the command -----------------------------------------------------------------------------------------------------


def load_target(config: HeadsConfig):
    """(frozen transformers target, target for decoding, tokenizer)."""
    from specdraft.models.registry import load_model, load_tokenizer

    dtype = EXPORT_DTYPES[config.target_dtype]
    target_model = load_model(config.target, dtype, backend="hf").model.eval().requires_grad_(False)
    return target_model, load_model(config.target, torch.float32), load_tokenizer(config.target)


@owns_out
def train_heads(config: HeadsConfig, command: str | None = None) -> Path:
    """Train heads of ``config.kind`` on the frozen target and export them; returns ``<out>/heads``."""
    kind = get_kind(config.kind)
    records = load_distill_records(config.data, config.allow_incomplete)
    train_records, heldout = split_by_prompt(records, config.heldout_every)
    target_model, target, tokenizer = load_target(config)
    check_token_ids(records, target.vocab_size, config.data)
    spec = kind.spec(target_model.config, config, config.kind_options())
    torch.manual_seed(config.seed)
    module = kind.build(spec)
    kind.init(module, target_model)
    if config.init_heads:
        _warm_start(module, config)
    plan, run_config = begin_stage("train-heads", config, data_inputs([config.data], init_heads=config.init_heads),
                                   HEADS_FOLDER)
    if plan.finished:
        return Path(config.out) / HEADS_FOLDER
    config = replace(config, bf16=run_config.bf16)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rank, _, device = init_distributed(config.device)
    target_model.to(device)
    evaluate = make_evaluate(config, kind, target_model, target, heldout, pad_id,
                             eos_token_ids(tokenizer, config.target))
    result = train(module, DistillDataset(train_records, config.max_seq_len),
                   lambda model, batch, generator: kind.loss(model, target_model, batch, generator), run_config,
                   lambda items: collate_distill(items, pad_id), evaluate)
    if rank == 0 and result.steps == config.steps:
        card = _card(config, result, command, spec, len(train_records), len(heldout))
        ranking = rank_tokens((r["response_token_ids"] for r in train_records), target.vocab_size)  # FR-Spec
        save_heads(module.cpu(), config.kind, spec, plan.work / HEADS_FOLDER, config.target, card,
                   EXPORT_DTYPES[config.export_dtype], ranking)
    end_stage(plan, config, result)
    return Path(config.out) / HEADS_FOLDER


def _warm_start(module, config: HeadsConfig) -> None:
    """Load ``config.init_heads`` into ``module``: heads of the same kind and shapes, else a clear error (loss
    settings such as Medusa's ``distill`` may differ)."""
    _, start = load_heads(config.init_heads, kind=config.kind)
    try:
        module.load_state_dict(start.state_dict())
    except RuntimeError as exc:
        raise SpecdraftError(f"init_heads {config.init_heads} has another architecture: "
                             f"{str(exc).splitlines()[0][:300]}") from None


def _card(config: HeadsConfig, result: TrainResult, command: str | None, spec: dict, n_train: int,
          n_heldout: int) -> str:
    """The heads' README.md: the command, data, budget and final metrics (checkpoint.model_card's layout)."""
    card = {"title": f"specdraft {config.kind} heads", "target": config.target,
            "dtype": str(EXPORT_DTYPES[config.export_dtype]),
            "command": command or shlex.join(sys.argv),
            "data": f"`{config.data}`: {n_train} target responses for training, {n_heldout} held out",
            "budget": {"Budget": f"{result.steps} steps, {result.tokens:,} response tokens, "
                                 f"{result.wall_seconds:.0f} s wall time ({result.tokens_per_second:.0f} tokens/s)",
                       "Hardware": f"{hardware(config.device)}, {int(os.environ.get('WORLD_SIZE', 1))} process(es)"},
            "metrics": {"train_loss": result.train_loss} | result.eval, "config": asdict(config) | {"spec": spec}}
    text = model_card(card)
    return text.replace("A draft model for speculative decoding", f"{config.kind} heads for speculative decoding", 1)
