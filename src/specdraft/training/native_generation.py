"""Distillation responses through the native Llama's ragged batched forwards (``distill-data --engine native``).

transformers' ``generate`` pads a batch to its longest prompt and grows its cache by concatenation every step,
which makes long prompts (articles to summarise, passages to answer from) dear. Here every prompt is prefilled on
its own row of a preallocated :class:`~specdraft.models.batched_llama.BatchedKVCache` (no padding), the rows then
decode together one token a step, and a row that ends leaves the batch (the last row moves into its place), so the
step shrinks as answers finish. The target's top-k log-probabilities are read from the same logits that choose
each token, as on the transformers path; the records have the same fields.
"""

from __future__ import annotations

import torch

from specdraft.models.batched_llama import batched_forward, new_batched_cache
from specdraft.sampling import SamplingConfig, sample, warp


@torch.inference_mode()
def generate_rows(model, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig, eos: int,
                  top_logprobs: int, generator: torch.Generator | None) -> list[dict]:
    """One response per prompt (repeat a prompt for several): token ids up to and including EOS, the finish reason
    ("eos" or "length") and, with ``top_logprobs`` > 0, the top-k of log p at every response token.

    Args:
        model: a :class:`~specdraft.models.native_llama.NativeLlama` (ragged batched forwards).
        prompts: token ids of each prompt (each at least one token).
    """
    n = len(prompts)
    cache = new_batched_cache(model, n, max(len(ids) for ids in prompts) + max_new_tokens)
    logits = torch.empty(n, model.vocab_size)  # (n, V) each row's next-token logits
    for row, ids in enumerate(prompts):  # each prompt alone: no padding
        logits[row] = batched_forward(model, cache, torch.tensor([ids]), [len(ids)], row, last_only=True)[0, 0]
    responses = [{"ids": [], "finish_reason": "length"} | ({"top_ids": [], "top_logprobs": []} if top_logprobs else {})
                 for _ in range(n)]
    owner = list(range(n))  # owner[r]: the response that cache row r is writing
    for step in range(max_new_tokens):
        active = len(owner)
        chosen = logits.argmax(-1) if sampling.greedy else sample(warp(logits, sampling), generator)  # (a,)
        if top_logprobs:
            top = torch.log_softmax(logits.float(), -1).topk(top_logprobs, dim=-1)  # (a, k)
            top_ids, top_values = top.indices.tolist(), top.values.tolist()
        tokens = chosen.tolist()
        alive = []
        for row in range(active):
            response = responses[owner[row]]
            response["ids"].append(tokens[row])
            if top_logprobs:
                response["top_ids"].append(top_ids[row])
                response["top_logprobs"].append(top_values[row])
            if tokens[row] == eos:
                response["finish_reason"] = "eos"
            else:
                alive.append(row)
        if not alive or step + 1 == max_new_tokens:
            break
        for dense, row in enumerate(alive):  # keep the live rows 0 .. m-1 (dense <= row: row `dense` is free)
            if dense != row:
                cache.move_row(row, dense)
        owner = [owner[row] for row in alive]
        fed = torch.tensor([[tokens[row]] for row in alive])  # (m, 1)
        logits = batched_forward(model, cache, fed, [1] * len(alive), 0)[:, 0]  # (m, V)
    return responses
