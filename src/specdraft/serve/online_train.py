"""One round of online distillation on the replay buffer: fine-tune a copy of the drafter on the stored top-k p
(any loss of :mod:`specdraft.training.objectives.losses` that trains against p), and score a drafter by its top-1
agreement with p on held-back records (Online Speculative Decoding, Liu et al. 2023, arXiv 2310.07177, Alg. 2).
Records, batches and the loss's target are those of ``specdraft finetune --use-stored-topk``.
"""

from __future__ import annotations

import copy

import torch

from specdraft.models.native_llama import NativeLlama
from specdraft.training.data.batches import (
    DistillDataset,
    collate_distill,
    dense_from_topk,
    response_logits,
    subset_from_topk,
)
from specdraft.training.objectives.losses import LOSSES, distillation_loss


def hf_from_native(native: NativeLlama):
    """A float32 transformers ``LlamaForCausalLM`` with the weights of ``native``: its decoder layers and final norm
    train, its token embeddings and LM head stay frozen."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(native.config).float()
    tensors = {key: value.float() for key, value in native.checkpoint_tensors().items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"drafter weights do not fit a LlamaForCausalLM: missing {missing}, extra {unexpected}")
    model.tie_weights()
    model.get_input_embeddings().weight.requires_grad_(False)  # shared with the target: never trained here
    model.get_output_embeddings().weight.requires_grad_(False)  # kept too: a draft vocabulary's rows are cut from it
    return model.eval()


def native_from_hf(model, like: NativeLlama) -> NativeLlama:
    """The serving copy of a trained transformers drafter, in ``like``'s dtype, name and weight layout."""
    native = NativeLlama(like.config, dtype=like.dtype, name=like.name)
    native.load_checkpoint_tensors(model.state_dict() | {"model.embed_tokens.weight": like.embed_weight},
                                   source=f"online distillation of {like.name}")
    native.prepack()
    return native


def kd_loss(model, batch: dict, loss: str, keep: torch.Tensor | None, vocab_size: int,
            options: dict | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """The chosen loss (with its settings ``options``; ``generator`` for a loss that samples) between the
    drafter's q and the stored top-k p at the response positions of ``batch``; with a draft vocabulary ``keep``
    (N,), over those N tokens (p renormalised on them)."""
    mask = batch["mask"]  # (B, T)
    draft = response_logits(model, batch, keep)  # (n, N or V)
    top_ids, top_logprobs = batch["top_ids"][mask], batch["top_logprobs"][mask]  # (n, k)
    target = (dense_from_topk(top_ids, top_logprobs, vocab_size) if keep is None
              else subset_from_topk(top_ids, top_logprobs, keep, vocab_size))  # (n, N or V)
    drawn = {"generator": generator} if LOSSES[loss].takes_generator and generator is not None else {}
    return distillation_loss(loss, draft, target, batch["labels"][mask], **(options or {}), **drawn)


def finetune_copy(model, records: list[dict], *, loss: str, steps: int, batch_size: int, lr: float,
                  max_seq_len: int, keep: torch.Tensor | None, pad_id: int, seed: int,
                  loss_options: dict | None = None):
    """A copy of ``model`` after ``steps`` AdamW steps on ``records`` (batches of ``batch_size``, reshuffled each
    pass) with the loss ``loss`` and its settings ``loss_options``; ``model`` itself is left unchanged."""
    candidate = copy.deepcopy(model).train()
    params = [p for p in candidate.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    dataset = DistillDataset(records, max_seq_len, topk=True)
    generator = torch.Generator().manual_seed(seed)
    order: list[int] = []
    for _ in range(steps):
        if len(order) < batch_size:
            order += torch.randperm(len(dataset), generator=generator).tolist()
        chosen, order = order[:batch_size], order[batch_size:]
        batch = collate_distill([dataset[i] for i in chosen], pad_id)
        value = kd_loss(candidate, batch, loss, keep, model.config.vocab_size, loss_options, generator)
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
    return candidate.eval()


@torch.no_grad()
def top1_agreement(model, records: list[dict], *, keep: torch.Tensor | None, pad_id: int, max_seq_len: int,
                   batch_size: int = 8) -> tuple[int, int]:
    """(positions where the drafter's greedy token equals the target's, positions) over the records' responses:
    greedy speculative decoding accepts a draft token exactly when they agree."""
    dataset = DistillDataset(records, max_seq_len, topk=True)
    agree = total = 0
    for start in range(0, len(dataset), batch_size):
        batch = collate_distill([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))], pad_id)
        choice = response_logits(model, batch, keep).argmax(-1)  # (n,)
        choice = choice if keep is None else keep[choice]
        target = batch["top_ids"][batch["mask"]][:, 0]  # (n,) the target's greedy token
        agree += int((choice == target).sum())
        total += int(target.shape[0])
    return agree, total


__all__ = ["finetune_copy", "hf_from_native", "kd_loss", "native_from_hf", "top1_agreement"]
