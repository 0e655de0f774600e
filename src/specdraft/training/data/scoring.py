"""The target's teacher-forced top-k log-probabilities at response tokens: what distillation data stores as its
approximation of p (``top_ids``, ``top_logprobs``), for responses of the target (``distill-topk``), of the drafter
(on-policy data, :mod:`specdraft.training.data.onpolicy`) and answers made elsewhere (``distill-data --answers``)."""

from __future__ import annotations

import torch


@torch.inference_mode()
def topk_logprobs(model, sequences: list[list[int]], starts: list[int], k: int, pad_id: int) -> list[tuple]:
    """Teacher-forced top-k of log p at the positions predicting tokens ``starts[i]..`` of each sequence.

    Returns per sequence (top_ids (R, k) list, top_logprobs (R, k) list), R = len(sequence) - starts[i].
    """
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id)  # (B, W) right-padded
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)], mask[row, : len(seq)] = torch.tensor(seq), 1
    device = next(model.parameters()).device
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits  # (B, W, V)
    out = []
    for row, (seq, start) in enumerate(zip(sequences, starts, strict=True)):
        rows = logits[row, start - 1 : len(seq) - 1].float()  # (R, V): position j predicts token j + 1
        top = torch.log_softmax(rows, -1).topk(k, dim=-1)  # (R, k)
        out.append((top.indices.tolist(), [[round(v, 4) for v in r] for r in top.values.tolist()]))
    return out


def score_records(target_model, records: list[dict], k: int, pad_id: int, batch_size: int) -> None:
    """Add the target's teacher-forced top-k log-probs (``top_ids``, ``top_logprobs``: (R, k) per record) to
    ``records`` in place: one forward over prompt + response per record, ``batch_size`` records per forward, in
    order of length."""
    order = sorted(range(len(records)), key=lambda i: len(records[i]["prompt_token_ids"])
                   + len(records[i]["response_token_ids"]))
    for begin in range(0, len(order), batch_size):
        batch = order[begin : begin + batch_size]
        sequences = [records[i]["prompt_token_ids"] + records[i]["response_token_ids"] for i in batch]
        starts = [len(records[i]["prompt_token_ids"]) for i in batch]
        for i, (top_ids, top_logprobs) in zip(batch, topk_logprobs(target_model, sequences, starts, k, pad_id),
                                              strict=True):
            records[i]["top_ids"], records[i]["top_logprobs"] = top_ids, top_logprobs


@torch.inference_mode()
def given_responses(target_model, prompts: list[list[int]], answers: list[list[int]], max_new_tokens: int, eos: int,
                    k: int, pad_id: int) -> list[dict]:
    """Responses of answers made elsewhere (token ids), cut to ``max_new_tokens``: ids, finish reason ("eos" when
    the answer ends with ``eos``, else "length") and, with ``k`` > 0, the target's teacher-forced top-k at each
    answer token (one forward over all the prompts + answers)."""
    responses = []
    for ids in answers:
        ids = list(ids[:max_new_tokens])
        responses.append({"ids": ids, "finish_reason": "eos" if ids[-1] == eos else "length"})
    if k:
        sequences = [prompt + r["ids"] for prompt, r in zip(prompts, responses, strict=True)]
        scored = topk_logprobs(target_model, sequences, [len(prompt) for prompt in prompts], k, pad_id)
        for response, (top_ids, top_logprobs) in zip(responses, scored, strict=True):
            response["top_ids"], response["top_logprobs"] = top_ids, top_logprobs
    return responses
