"""Stage 2 of draft training (Goel et al. 2024, arXiv 2403.00858): align a pretrained drafter with the
target by knowledge distillation on the target's own responses (made by ``specdraft distill-data``).

Each example is the prompt followed by the target's response, right-padded in a batch. The loss counts only the
positions whose label is a response token. The target distribution p is computed on the fly under
``torch.no_grad()`` by the transformers target, or, with ``use_stored_topk``, rebuilt from the top-k
log-probabilities stored in the data: the stored k tokens keep their log-probabilities and the remaining mass is
spread uniformly over the other tokens. That is an approximation of p, labelled as such in the model card.

Draft vocabulary (``draft_vocab`` = N > 0): the drafter is trained to draft only the N tokens most frequent in the
training responses (FR-Spec, Zhao et al. 2025, arXiv 2502.14856; :mod:`specdraft.draft_vocab`), which is how it is
then run with ``--drafter-option draft_vocab=N``. Its logits are computed for those N rows of the LM head only (for
a small drafter with a 49k-token vocabulary the head is most of the training step) and p is restricted to the same
N tokens and renormalised, so q is trained over exactly the support it drafts from.

Evaluation (every ``eval_every`` steps and at the end) reports the held-out loss, TVD (1 − TVD is the expected
acceptance rate) and forward KL against the real target, and the block efficiency τ of greedy speculative decoding
with the real decoder (:func:`specdraft.decoding.generate`) on prompts whose responses were held out.

On-policy options: OSD's ``only_mismatched`` (:mod:`specdraft.training.data.onpolicy`), DistillSpec's
``regenerate_every`` (:mod:`specdraft.training.drafter.regenerate`).

This module is the stage's entry point; the pieces it runs live beside it: the records and their split
(:mod:`specdraft.training.data.records`), the batches (:mod:`specdraft.training.data.batches`), the settings
(:mod:`specdraft.training.drafter.finetune_config`), and the loss and evaluation
(:mod:`specdraft.training.drafter.distillation`).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

from specdraft.compat import check_compatible
from specdraft.draft_vocab import load_token_ranking, rank_tokens
from specdraft.errors import SpecdraftError
from specdraft.models.quantized_llama import fits_blocks
from specdraft.models.registry import eos_token_ids, load_model, load_tokenizer, resolve
from specdraft.models.shared_embeddings import target_weights
from specdraft.training.data.batches import DistillDataset, collate_distill
from specdraft.training.data.records import check_token_ids, data_folders, load_distill_records, split_by_prompt
from specdraft.training.drafter import regenerate
from specdraft.training.drafter.distillation import make_evaluate, make_kd_loss
from specdraft.training.drafter.finetune_config import FinetuneConfig
from specdraft.training.drafter.init_drafter import load_trained_drafter
from specdraft.training.runs.checkpoint import EXPORT_DTYPES, export_hf, export_path, hardware
from specdraft.training.runs.folders import owns_out
from specdraft.training.runs.stages import begin_stage, data_inputs, end_stage
from specdraft.training.runs.trainer import TrainResult, init_distributed, train

__all__ = ["FinetuneConfig", "finetune", "load_models"]


def load_models(config: FinetuneConfig):
    """(drafter to train, transformers target, target for decoding, target tokenizer), with the vocabularies
    checked before any training."""
    from specdraft.models.hf import HFCausalLM  # transformers' generation code: loaded when used (CLI start)

    dtype = EXPORT_DTYPES[config.target_dtype]
    target, tokenizer = load_model(config.target, torch.float32), load_tokenizer(config.target)
    drafter = load_trained_drafter(config.drafter, target)  # a --share-embeddings export gets the target's table
    target_model = load_model(config.target, dtype, backend="hf").model.eval().requires_grad_(False)
    if config.freeze_embeddings:
        drafter.get_input_embeddings().weight.requires_grad_(False)  # tied: the LM head too
    if config.share_embeddings:
        _check_same_embeddings(drafter, target, config.drafter)
    draft_tokenizer = None  # a bare checkpoint: only the vocabulary size can be checked
    with contextlib.suppress(SpecdraftError):
        draft_tokenizer = load_tokenizer(config.drafter)
    check_compatible(target, tokenizer, HFCausalLM(drafter, name=config.drafter), draft_tokenizer)
    return drafter, target_model, target, tokenizer


def _check_same_embeddings(drafter, target, name: str) -> None:
    """--share-embeddings: the drafter's table must be the target's (up to bf16 rounding), or the exported drafter
    would draft from a table it was not trained with."""
    mine, theirs = drafter.get_input_embeddings().weight.detach().float(), target_weights(target)[0].detach().float()
    if mine.shape != theirs.shape or not torch.allclose(mine, theirs, rtol=1e-2, atol=1e-6):
        raise SpecdraftError(f"--share-embeddings: drafter {name!r} does not have the target's token embeddings "
                             f"(shape {tuple(mine.shape)} against {tuple(theirs.shape)}); start from "
                             "`specdraft init-drafter` or drop the flag")


@owns_out
def finetune(config: FinetuneConfig, command: str | None = None) -> Path:
    """Run stage 2 and export the aligned drafter; returns the exported folder ``<out>/model``."""
    need_topk = config.objective().reads_topk
    records = [record for folder in data_folders(config.data)
               for record in load_distill_records(folder, config.allow_incomplete, need_topk)]
    train_records, heldout = split_by_prompt(records, config.heldout_every)
    drafter, target_model, target, tokenizer = load_models(config)
    check_token_ids(records, target.vocab_size, config.data)
    plan, run_config = begin_stage("finetune", config, data_inputs(data_folders(config.data), drafter=config.drafter),
                                   export_path("").name)
    if plan.finished:
        return export_path(config.out)
    config = replace(config, bf16=run_config.bf16)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ranking = (load_token_ranking(resolve(config.draft_vocab_from), target.vocab_size) if config.draft_vocab_from
               else rank_tokens((r["response_token_ids"] for r in train_records), target.vocab_size))  # (V,)
    keep = ranking[: config.draft_vocab] if 0 < config.draft_vocab < target.vocab_size else None  # (N,)
    rank, _, device = init_distributed(config.device)
    target_model.to(device)
    keep = None if keep is None else keep.to(device)
    evaluate = make_evaluate(config.evaluation(), config.objective(), target_model, target, heldout, pad_id,
                             eos_token_ids(tokenizer, config.target), keep)
    pool = regenerate.regenerator(run_config.regeneration(), train_records, need_topk, target_model, tokenizer,
                                  keep)  # adds a pool
    result = train(drafter, DistillDataset(train_records, config.max_seq_len, need_topk),
                   make_kd_loss(config.objective(), target_model, keep), run_config,
                   lambda items: collate_distill(items, pad_id), evaluate, after_step=pool)
    if rank == 0 and result.steps == config.steps:
        trained = len(train_records) - (pool.size if pool else 0)
        data = (f"`{config.data}`: {trained} responses for training, {len(heldout)} held out"
                + ("; p approximated from the stored top-k log-probabilities" if need_topk else "")
                + (f"; {pool.size} of them answered afresh by the drafter every {config.regenerate_every} steps"
                   if pool else ""))
        export_hf(drafter.cpu(), export_path(plan.work), config.target, _card(config, result, command, data),
                  EXPORT_DTYPES[config.export_dtype], share_embeddings=config.share_embeddings, ranking=ranking,
                  options=_folder_options(drafter.config, config.draft_vocab if keep is not None else None))
    end_stage(plan, config, result)
    return export_path(config.out)


def _folder_options(model_config, draft_vocab: int | None) -> dict[str, object] | None:
    """The options the exported folder drafts with by default: its ``draft_vocab``, and ``quantize: int8`` where the
    draft model fits the int8 kernels (Q8_0 blocks: ~3x cheaper drafting on CPU than fp32 weights; dropped at load
    where the kernels cannot run, ``quantize=none`` keeps the dense weights). The learning curve's exact τ is the
    dense drafter's."""
    options: dict[str, object] = {} if draft_vocab is None else {"draft_vocab": draft_vocab}
    if fits_blocks(model_config):
        options["quantize"] = "int8"
    return options or None


def _card(config: FinetuneConfig, result: TrainResult, command: str | None, data: str) -> dict:
    budget = {"Budget": f"{result.steps} steps, {result.tokens:,} response tokens, {result.wall_seconds:.0f} s "
                        f"wall time ({result.tokens_per_second:.0f} tokens/s)",
              "Hardware": f"{hardware(config.device)}, {int(os.environ.get('WORLD_SIZE', 1))} process(es)",
              "Loss": f"{config.loss} {config.loss_settings()}"}
    return {"title": f"specdraft drafter (distilled, {config.loss})", "command": command or shlex.join(sys.argv),
            "data": data, "budget": budget, "metrics": {"train_loss": result.train_loss} | result.eval,
            "config": asdict(config)}
