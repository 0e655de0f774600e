"""How ``specdraft train-heads`` sees a kind of self-drafting heads (:class:`HeadKind`), and the two kinds it
trains: Medusa-1 (Cai et al. 2024, arXiv 2401.10774) and EAGLE (Li et al. 2024, arXiv 2401.15077).

The architectures, their specs and their pure losses live in :mod:`specdraft.heads`; this module adds what only
training needs: the teacher features of the frozen transformers target, the loss and held-out metrics on a batch,
and a drafter over an in-memory module for block-efficiency evaluation. The registry of kinds is
:data:`specdraft.training.heads.train_heads.HEAD_KINDS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.drafters.eagle import EagleDrafter
from specdraft.drafters.medusa import MedusaDrafter
from specdraft.heads.eagle import LOSS_OPTIONS, EagleHead, build_eagle, eagle_loss, eagle_spec
from specdraft.heads.medusa import DEFAULT_DECAY, MedusaHeads, build_medusa, medusa_loss, medusa_spec
from specdraft.models.shared_embeddings import target_weights


@dataclass(frozen=True)
class HeadKind:
    """One kind of heads, as the generic trainer and loader see it.

    spec(target_config, config, options) -> dict: the JSON architecture (and loss settings) from the frozen
        target's transformers config, the run's :class:`~specdraft.training.heads.train_heads.HeadsConfig` and its
        ``options`` (``KEY=VALUE`` strings already split into a dict); it must hold ``vocab_size`` and ``hidden_size``.
    build(spec) -> nn.Module: a fresh module (deterministic under ``torch.manual_seed``).
    init(module, target_model): copy what starts from the frozen transformers target (e.g. its LM head).
    loss(module, target_model, batch, generator) -> (scalar loss, counted positions): ``batch`` as
        :func:`specdraft.training.data.batches.collate_distill` makes it; teacher features come from
        :func:`teacher_hidden` (no gradient); ``generator`` is the trainer's (checkpointed) for what the loss draws.
    metrics(module, target_model, batch) -> {name: (sum, count)}: held-out statistics, pooled over batches as
        sum / count by the evaluator.
    drafter(module) -> Drafter or None: a drafter over an in-memory module, for block-efficiency evaluation.
    """

    spec: Callable[[Any, Any, dict[str, str]], dict]
    build: Callable[[dict], nn.Module]
    init: Callable[[nn.Module, nn.Module], None]
    loss: Callable[[nn.Module, nn.Module, dict, torch.Generator | None], tuple[torch.Tensor, int]]
    metrics: Callable[[nn.Module, nn.Module, dict], dict[str, tuple[float, int]]]
    drafter: Callable[[nn.Module], Any] | None = None


@torch.no_grad()
def teacher_hidden(target_model, batch: dict) -> torch.Tensor:
    """The frozen target's final-normed hidden states (B, T, D) (its LM head's input) for a right-padded batch."""
    out = target_model.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                  use_cache=False)
    return out.last_hidden_state  # (B, T, D)


def lm_head_weight(target_model) -> torch.Tensor:
    """The frozen target's LM head weight (V, D)."""
    return target_model.get_output_embeddings().weight


# --- Medusa ----------------------------------------------------------------------------------------------------------


def _medusa_init(module: MedusaHeads, target_model) -> None:
    module.init_from_lm_head(target_model.get_output_embeddings().weight.detach().float())


def _medusa_logits(module, target_model, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Head logits (K, B, T, V) and, for self-distillation, the target's probabilities (B, T, V) (else None)."""
    hidden = teacher_hidden(target_model, batch)  # (B, T, D), no gradient
    heads = getattr(module, "module", module)  # DistributedDataParallel wraps the heads
    teacher = None
    if getattr(heads, "distill", False):
        with torch.no_grad():
            teacher = torch.softmax(F.linear(hidden, lm_head_weight(target_model)).float(), dim=-1)  # (B, T, V)
    return module(hidden, lm_head_weight(target_model) if heads.share_lm_head else None), teacher  # (K, B, T, V)


def _medusa_loss(module, target_model, batch: dict,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, int]:
    decay = getattr(getattr(module, "module", module), "decay", DEFAULT_DECAY)
    logits, teacher = _medusa_logits(module, target_model, batch)
    loss, _, count = medusa_loss(logits, batch["labels"], batch["mask"], decay, teacher)
    return loss, count


def _medusa_metrics(module, target_model, batch: dict) -> dict[str, tuple[float, int]]:
    logits, teacher = _medusa_logits(module, target_model, batch)
    decay = getattr(module, "decay", DEFAULT_DECAY)
    loss, accuracy, count = medusa_loss(logits, batch["labels"], batch["mask"], decay, teacher)
    metrics = {"heldout_loss": (float(loss) * count, count)}
    return metrics | {f"head{k}_top1": acc for k, acc in enumerate(accuracy, start=1)}


def _medusa_drafter(module: MedusaHeads):
    return MedusaDrafter.from_module(module)


MEDUSA = HeadKind(spec=medusa_spec, build=build_medusa, init=_medusa_init, loss=_medusa_loss, metrics=_medusa_metrics,
                  drafter=_medusa_drafter)


# --- EAGLE -----------------------------------------------------------------------------------------------------------


def _eagle_init(module: EagleHead, target_model) -> None:
    """Nothing starts from the target: the embeddings and LM head stay the target's, read at every use."""


def _eagle_pairs(module, target_model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher features (B, T + 1, D) of the whole sequences, the sequences (B, T + 1) and the pair mask (B, T)."""
    tokens = torch.cat([batch["input_ids"][:, :1], batch["labels"]], dim=1)  # (B, T + 1)
    seen = torch.cat([batch["attention_mask"][:, :1], batch["attention_mask"]], dim=1)  # (B, T + 1)
    features = teacher_hidden(target_model, {"input_ids": tokens, "attention_mask": seen})  # (B, T + 1, D)
    return features, tokens, batch["mask"]


def _eagle_loss(module, target_model, batch: dict,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, int]:
    settings = getattr(getattr(module, "module", module), "loss_settings", LOSS_OPTIONS)  # DDP wraps the head
    features, tokens, mask = _eagle_pairs(module, target_model, batch)
    embed, lm_head = target_weights(target_model)
    return eagle_loss(module, features, tokens, mask, embed, lm_head, settings["cls_weight"], settings["reg_weight"],
                      settings["noise"], settings.get("partial_alignment", 0.0), generator)


@torch.no_grad()
def _eagle_metrics(module, target_model, batch: dict) -> dict[str, tuple[float, int]]:
    """Held-out loss, feature regression error and top-1 agreement of the head's next-next token with the target's."""
    features, tokens, mask = _eagle_pairs(module, target_model, batch)
    embed, lm_head = target_weights(target_model)
    loss, count = eagle_loss(module, features, tokens, mask, embed, lm_head, **{
        k: v for k, v in getattr(module, "loss_settings", LOSS_OPTIONS).items() if k != "noise"})
    predicted = module(features[:, :-1], F.embedding(tokens[:, 1:], embed))[mask].float()  # (n, D)
    truth = features[:, 1:][mask].float()  # (n, D)
    lm_head = lm_head.float()
    agree = (F.linear(predicted, lm_head).argmax(-1) == F.linear(truth, lm_head).argmax(-1)).sum()
    return {"heldout_loss": (float(loss) * count, count),
            "heldout_smooth_l1": (float(F.smooth_l1_loss(predicted, truth, reduction="sum")) / max(truth.shape[-1], 1),
                                  count),
            "heldout_top1": (float(agree), count)}


def _eagle_drafter(module: EagleHead):
    return EagleDrafter.from_module(module)


EAGLE = HeadKind(spec=eagle_spec, build=build_eagle, init=_eagle_init, loss=_eagle_loss, metrics=_eagle_metrics,
                 drafter=_eagle_drafter)
