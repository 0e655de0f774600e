"""Batches of prompt + response sequences for the training stages that learn on the target's responses (Goel et
al. 2024, arXiv 2403.00858, stage 2: KD on response tokens only), and the logits they are scored with.

Each example is the prompt followed by the target's response, right-padded in a batch; ``mask`` marks the positions
whose label is a response token. The stored top-k log-probabilities of p rebuild an approximate p (the stored k
tokens keep their log-probabilities and the remaining mass is spread uniformly over the other tokens), over the
whole vocabulary or a draft vocabulary's N tokens (FR-Spec, Zhao et al. 2025, arXiv 2502.14856).
"""

from __future__ import annotations

import math

import torch


class DistillDataset(torch.utils.data.Dataset):
    """Prompt + response token sequences of at most ``max_seq_len + 1`` tokens, with the prompt length.

    A sequence that is too long loses the start of its prompt first (down to half the window), then the end of its
    response: a long prompt (an article to summarise) keeps its end and its whole response, which are what the
    drafter is trained on, instead of leaving no response token at all.
    """

    def __init__(self, records: list[dict], max_seq_len: int, topk: bool = False) -> None:
        self.records, self.max_len, self.topk = records, max_seq_len + 1, topk

    def __len__(self) -> int:
        return len(self.records)

    @property
    def lengths(self) -> list[int]:
        """Each example's token count as :meth:`__getitem__` cuts it (for length-grouped batches)."""
        return [min(len(r["prompt_token_ids"]) + len(r["response_token_ids"]), self.max_len) for r in self.records]

    def __getitem__(self, index: int) -> dict:
        record = self.records[index]
        prompt, response = record["prompt_token_ids"], record["response_token_ids"]
        excess = len(prompt) + len(response) - self.max_len
        drop = min(max(excess, 0), max(len(prompt) - self.max_len // 2, 0))  # prompt tokens cut from the left
        ids = (prompt[drop:] + response)[: self.max_len]
        item = {"ids": torch.tensor(ids), "prompt_len": len(prompt) - drop}
        if self.topk:
            item["top_ids"] = torch.tensor(record["top_ids"])  # (R, k): distribution of response token r
            item["top_logprobs"] = torch.tensor(record["top_logprobs"], dtype=torch.float32)  # (R, k)
        return item


def collate_distill(items: list[dict], pad_id: int) -> dict:
    """Right-padded batch: input_ids, labels, attention_mask, mask (True where the label is a response token),
    and with stored top-k, ``top_ids`` / ``top_logprobs`` (B, T, k) aligned with the labels."""
    width = max(item["ids"].shape[0] for item in items) - 1  # T
    batch = {"input_ids": torch.full((len(items), width), pad_id), "labels": torch.full((len(items), width), pad_id),
             "attention_mask": torch.zeros(len(items), width, dtype=torch.long),
             "mask": torch.zeros(len(items), width, dtype=torch.bool)}
    topk = "top_ids" in items[0]
    if topk:
        k = items[0]["top_ids"].shape[-1]
        batch["top_ids"] = torch.zeros(len(items), width, k, dtype=torch.long)
        batch["top_logprobs"] = torch.zeros(len(items), width, k)
    for row, item in enumerate(items):
        ids, start = item["ids"], item["prompt_len"] - 1  # label j is ids[j + 1]: a response token from j = P - 1
        length = ids.shape[0] - 1
        batch["input_ids"][row, :length], batch["labels"][row, :length] = ids[:-1], ids[1:]
        batch["attention_mask"][row, :length] = 1
        batch["mask"][row, start:length] = True
        if topk and length > start:
            batch["top_ids"][row, start:length] = item["top_ids"][: length - start]
            batch["top_logprobs"][row, start:length] = item["top_logprobs"][: length - start]
    return batch


def dense_from_topk(top_ids: torch.Tensor, top_logprobs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Approximate log p (n, V) from top-k (n, k): stored entries kept, leftover mass spread evenly elsewhere."""
    rest = (1.0 - top_logprobs.exp().sum(-1, keepdim=True)).clamp_min(1e-9)  # (n, 1)
    fill = rest.log() - math.log(max(vocab_size - top_ids.shape[-1], 1))  # (n, 1)
    dense = fill.expand(-1, vocab_size).clone()  # (n, V)
    return dense.scatter_(-1, top_ids, top_logprobs)


def subset_from_topk(top_ids: torch.Tensor, top_logprobs: torch.Tensor, keep: torch.Tensor,
                     vocab_size: int) -> torch.Tensor:
    """``dense_from_topk(top_ids, top_logprobs, vocab_size)[:, keep]`` (n, N) without building the (n, V) table.

    Args:
        top_ids, top_logprobs: (n, k) the stored top-k of p.
        keep: (N,) distinct token ids (the draft vocabulary).
    """
    column = _columns(keep, vocab_size, missing=keep.shape[0])  # (V,): N = not kept
    rest = (1.0 - top_logprobs.exp().sum(-1, keepdim=True)).clamp_min(1e-9)  # (n, 1)
    fill = rest.log() - math.log(max(vocab_size - top_ids.shape[-1], 1))  # (n, 1)
    out = fill.expand(-1, keep.shape[0] + 1).clone()  # (n, N + 1): the extra column takes the ids not kept
    return out.scatter_(-1, column[top_ids], top_logprobs)[:, :-1]


def _columns(keep: torch.Tensor, vocab_size: int, missing: int) -> torch.Tensor:
    """(V,) the column of each token id in ``keep`` (N,), ``missing`` for ids not kept."""
    column = torch.full((vocab_size,), missing, dtype=torch.long, device=keep.device)
    column[keep] = torch.arange(keep.shape[0], device=keep.device)
    return column


def subset_labels(labels: torch.Tensor, keep: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels (n,) as columns of ``keep`` (n,), and the mask (n,) of those inside it (the others cannot be drafted)."""
    columns = _columns(keep, vocab_size, missing=-1)[labels]  # (n,)
    return columns.clamp_min(0), columns >= 0


def response_logits(model, batch: dict, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The drafter's logits (n, V) at the response positions of a batch (``batch["mask"]``); with ``keep`` (N,),
    only those columns (n, N).

    For a Llama the LM head runs on those positions only, and on the ``keep`` rows only: it is most of a small
    drafter's cost, and prompt positions carry no loss. Other architectures (whose heads may scale or cap logits)
    and wrapped or sharded models (DDP, FSDP: their hooks run on the whole module's forward) run their full forward.
    """
    from torch.distributed.fsdp import FSDPModule

    mask = batch["mask"]  # (B, T)
    plain = not isinstance(model, FSDPModule) and getattr(getattr(model, "config", None), "model_type", None)
    if plain == "llama" and hasattr(model, "lm_head") and getattr(model.lm_head, "bias", None) is None:
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             use_cache=False).last_hidden_state  # (B, T, D)
        weight = model.lm_head.weight if keep is None else model.lm_head.weight[keep]  # (V or N, D)
        return torch.nn.functional.linear(hidden[mask], weight)  # (n, V or N)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    return logits[mask] if keep is None else logits[mask][:, keep]


@torch.no_grad()
def target_logits(target_model, batch: dict) -> torch.Tensor:
    """The target's logits (B, T, V) for a right-padded batch, without gradient."""
    return target_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits

