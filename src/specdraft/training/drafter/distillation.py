"""The knowledge-distillation objective of ``specdraft finetune`` and its evaluation (Goel et al. 2024, arXiv
2403.00858, stage 2).

The loss counts only the positions whose label is a response token, against the target's p computed on the fly
under ``torch.no_grad()`` or, with ``use_stored_topk``, rebuilt from the stored top-k (an approximation); with a
draft vocabulary (FR-Spec, Zhao et al. 2025, arXiv 2502.14856) q and p are both restricted to its N tokens, p
renormalised. OSD's ``only_mismatched`` (:mod:`specdraft.training.data.onpolicy`) keeps only the positions greedy
verification would reject.

Evaluation reports the held-out loss, TVD (1 − TVD is the expected acceptance rate) and forward KL against the real
target, and the block efficiency τ of greedy speculative decoding with the real decoder
(:func:`specdraft.decoding.generate`); on the target's greedy answers also the exact greedy τ
(:mod:`specdraft.training.objectives.tau`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdraft.decoding import GenerationConfig, generate
from specdraft.draft_vocab import DraftVocab
from specdraft.drafters.draft_model import DraftModelDrafter
from specdraft.models.native_llama import NativeLlama, supports
from specdraft.training.data import onpolicy
from specdraft.training.data.batches import (
    DistillDataset,
    collate_distill,
    dense_from_topk,
    response_logits,
    subset_from_topk,
    subset_labels,
    target_logits,
)
from specdraft.training.data.records import greedy_answers
from specdraft.training.objectives.losses import LOSSES, forward_kl, tvd
from specdraft.training.objectives.tau import greedy_tau, response_ranks


@dataclass(frozen=True)
class Objective:
    """What finetune's loss reads: the loss (a name of :data:`~specdraft.training.objectives.losses.LOSSES`) with
    its settings, whether p comes from the stored top-k, and whether only OSD's mismatched positions count."""

    loss: str = "fkl"
    settings: dict = field(default_factory=dict)
    use_stored_topk: bool = False
    only_mismatched: bool = False

    @property
    def reads_topk(self) -> bool:
        """Whether the data must hold the target's top-k (a loss on the labels never reads p)."""
        return self.use_stored_topk and LOSSES[self.loss].needs_target


@dataclass(frozen=True)
class Evaluation:
    """What finetune's evaluation reads: the γ values, the prompts decoded and their length, the batches of the
    held-out (or ``data``'s) answers, and bf16 autocast."""

    num_draft_tokens: tuple[int, ...] = (3, 5)
    prompts: int = 8
    max_new_tokens: int = 64
    max_seq_len: int = 512
    batch_size: int = 16
    bf16: bool = False
    data: str = ""  # evaluate on this distill-data folder instead of the held-out split


def make_kd_loss(objective: Objective, target_model, keep: torch.Tensor | None = None):
    """loss_fn(model, batch, generator) for the trainer: the chosen loss on response positions only; with ``keep``
    (N,) on the draft vocabulary (q and p both over those N tokens, p renormalised by the loss's softmax). The
    target's LM head, like the drafter's, runs on those positions and rows only (a Llama's full (B, T, V) logits
    would cost a fifth of its forward and most of the step's memory traffic)."""
    vocab_size = target_model.config.vocab_size
    needs_target = LOSSES[objective.loss].needs_target

    def kd_loss(model, batch: dict, generator: torch.Generator) -> tuple[torch.Tensor, int]:
        mask = batch["mask"]  # (B, T)
        draft = response_logits(model, batch, keep)  # (n, N) or (n, V)
        target = None
        if needs_target and objective.use_stored_topk:
            top_ids, top_logprobs = batch["top_ids"][mask], batch["top_logprobs"][mask]  # (n, k)
            target = (dense_from_topk(top_ids, top_logprobs, vocab_size) if keep is None
                      else subset_from_topk(top_ids, top_logprobs, keep, vocab_size))
        elif needs_target:
            with torch.no_grad():  # the teacher's head on response positions and kept rows only
                target = response_logits(target_model, batch, keep)  # (n, N) or (n, V)
        labels = batch["labels"][mask]  # (n,)
        if objective.only_mismatched:  # OSD: only the positions whose draft greedy verification would reject
            draft, target, labels = onpolicy.mismatched(draft, target, labels)
            if draft.shape[0] == 0:
                return draft.sum(), 0
        return _kd_value(objective, draft, target, labels, keep, vocab_size, generator), draft.shape[0]

    return kd_loss


def _kd_value(objective: Objective, draft: torch.Tensor, target: torch.Tensor | None, labels: torch.Tensor,
              keep: torch.Tensor | None, vocab_size: int, generator: torch.Generator | None) -> torch.Tensor:
    """The objective's loss of ``draft`` (n, N or V) against ``target`` (same columns) or ``labels`` (n,); with a
    draft vocabulary ``keep``, a loss on the labels counts only those inside it (the others cannot be drafted)."""
    loss, counted = LOSSES[objective.loss], None
    if not loss.needs_target and keep is not None:
        labels, counted = subset_labels(labels, keep, vocab_size)
    drawn = {"generator": generator} if loss.takes_generator and generator is not None else {}
    return loss(draft, target, labels, counted, **objective.settings, **drawn)


def heldout_metrics(model, target_model, batches: list[dict], objective: Objective, bf16: bool,
                    keep: torch.Tensor | None = None) -> dict[str, float]:
    """On held-out response positions, against the real target (never the stored top-k): the training loss, TVD
    (1 − TVD is the expected acceptance rate) and forward KL, each a mean over positions.

    With a draft vocabulary ``keep`` (N,), TVD is the exact one of the drafter as run (q = 0 outside ``keep``,
    against the full p), while the loss and forward KL compare q with p restricted to ``keep`` and renormalised
    (the training objective; the full KL would be infinite), and ``heldout_coverage`` is p's mass inside ``keep``.
    """
    device = next(model.parameters()).device
    vocab_size = target_model.config.vocab_size
    vocab = None if keep is None else DraftVocab(torch.empty(vocab_size, 0, device=device), keep)
    sums, count = {"heldout_loss": 0.0, "heldout_tvd": 0.0, "heldout_fkl": 0.0}, 0
    if keep is not None:
        sums["heldout_coverage"] = 0.0
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        mask = batch["mask"]  # (B, T)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            draft = response_logits(model, batch, keep)  # (n, N) or (n, V)
            target = target_logits(target_model, batch)[mask]  # (n, V)
        n = int(mask.sum())
        kept = target if keep is None else target[:, keep]  # (n, N or V)
        generator = torch.Generator(device=device).manual_seed(0)
        loss = _kd_value(objective, draft, kept, batch["labels"][mask], keep, vocab_size, generator)
        if keep is not None:
            sums["heldout_coverage"] += float(torch.softmax(target.float(), -1)[:, keep].sum(-1).sum())
        sums["heldout_loss"] += float(loss) * n
        as_run = draft if vocab is None else vocab.expand(draft)  # (n, V): q = 0 outside keep, as drafted
        sums["heldout_tvd"] += float(tvd(as_run, target)) * n
        sums["heldout_fkl"] += float(forward_kl(draft, kept)) * n
        count += n
    return {k: v / max(count, 1) for k, v in sums.items()}


def block_efficiency(target, drafter_model, prompts: Sequence[Sequence[int]], num_draft_tokens: int,
                     max_new_tokens: int, eos_token_ids: tuple[int, ...] = (),
                     keep: torch.Tensor | None = None) -> float:
    """τ = new tokens / target forwards of greedy speculative decoding over ``prompts``, pooled.

    Args:
        target: a :class:`~specdraft.models.base.CausalLM`.
        drafter_model: a transformers causal LM (copied to the native fp32 implementation when it is a Llama).
        keep: (N,) the draft vocabulary, or None for the whole vocabulary.
    """
    from specdraft.models.hf import HFCausalLM  # transformers' generation code: loaded when used (CLI start)

    if supports(drafter_model.config):
        draft = NativeLlama.from_hf(drafter_model, torch.float32)  # a CPU fp32 copy
    else:
        draft = HFCausalLM(drafter_model)
    config = GenerationConfig(max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens, speculation="fixed",
                              eos_token_ids=tuple(eos_token_ids))
    keep = None if keep is None else keep.cpu()
    new_tokens, forwards = 0, 0
    for prompt in prompts:
        stats = generate(target, list(prompt), DraftModelDrafter(draft, keep=keep), config).stats
        new_tokens, forwards = new_tokens + stats.new_tokens, forwards + stats.target_forward_calls
    return new_tokens / max(forwards, 1)


def draft_logits_fn(model, keep: torch.Tensor | None, bf16: bool):
    """batch -> the drafter's logits at the batch's response positions (:func:`response_logits`), the batch moved to
    the drafter's device and run under bf16 autocast when ``bf16`` (for :mod:`specdraft.training.objectives.tau`)."""
    device = next(model.parameters()).device

    def logits(batch: dict) -> torch.Tensor:
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            return response_logits(model, {k: v.to(device) for k, v in batch.items()}, keep)

    return logits


def make_evaluate(evaluation: Evaluation, objective: Objective, target_model, target, heldout: list[dict],
                  pad_id: int, eos: tuple, keep: torch.Tensor | None = None):
    """evaluate(model) for the trainer: held-out loss, TVD, forward KL and block efficiency at each γ; with
    ``evaluation.data``, those on its records, and on the target's greedy answers the exact greedy τ
    (:mod:`specdraft.training.objectives.tau`)."""
    heldout, exact = greedy_answers(evaluation.data) if evaluation.data else (heldout, False)
    longest = max(len(r["prompt_token_ids"]) + len(r["response_token_ids"]) for r in heldout)
    dataset = DistillDataset(heldout, longest if evaluation.data else evaluation.max_seq_len)  # data: whole, as run
    size = evaluation.batch_size
    batches = [collate_distill([dataset[i] for i in range(s, min(s + size, len(dataset)))], pad_id)
               for s in range(0, len(dataset), size)]
    prompts = list(dict.fromkeys(tuple(r["prompt_token_ids"]) for r in heldout))[: evaluation.prompts]

    def evaluate(model) -> dict[str, float]:
        metrics = heldout_metrics(model, target_model, batches, objective, evaluation.bf16, keep)
        if exact:
            ranks = response_ranks(draft_logits_fn(model, keep, evaluation.bf16), batches, keep, top=1)
            metrics |= greedy_tau(ranks, list(evaluation.num_draft_tokens))
        for k in evaluation.num_draft_tokens:
            if prompts:
                metrics[f"block_efficiency@{k}"] = block_efficiency(target, model, prompts, k,
                                                                    evaluation.max_new_tokens, eos, keep)
        return metrics

    return evaluate

