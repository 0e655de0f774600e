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


class StaticEngine:
    """The native target and the :class:`~specdraft.models.static_batch.StaticBatch` it decodes in, kept across
    calls (its CUDA graphs with it): a new batch is allocated only when a call needs more rows or slots. The engine
    of ``distill-data --engine native`` on CUDA."""

    def __init__(self, model, graphs: bool = True) -> None:
        self.model, self.graphs, self.batch = model, graphs, None
        self.row_steps = 0  # rows decoded, summed over every decode step so far (live or running along)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig, eos: int,
                 top_logprobs: int, generator: torch.Generator | None) -> list[dict]:
        """As :func:`generate_rows` (``generator`` on the model's device)."""
        from specdraft.models.static_batch import StaticBatch

        rows, capacity = len(prompts), max(len(ids) for ids in prompts) + max_new_tokens
        if self.batch is None or self.batch.rows < rows or self.batch.capacity < capacity:
            rows = max(rows, self.batch.rows if self.batch is not None else 0)
            self.batch = None  # its cache is freed before the new one is allocated
            if self.model.embed_weight.device.type == "cuda":
                torch.cuda.empty_cache()
            capacity = min(self.model.max_context, -(-capacity // 256) * 256)  # fewer reallocations
            self.batch = StaticBatch(self.model, rows, capacity, self.graphs)
        responses, row_steps = generate_rows_static(self.batch, prompts, max_new_tokens, sampling, eos, top_logprobs,
                                                    generator)
        self.row_steps += row_steps
        return responses


@torch.inference_mode()
def generate_rows_static(batch, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig, eos: int,
                         top_logprobs: int, generator: torch.Generator | None, check_every: int = 16
                         ) -> tuple[list[dict], int]:
    """:func:`generate_rows` in a static batch: every row decodes each step (no host sync per token); every
    ``check_every`` steps the rows that reached EOS are counted, the loop ends when none is left, and when at most
    half of the rows run still live they move to the front and a smaller batch runs on. Returns the responses and
    the rows decoded over all steps (answer tokens / that = the share of the decode work that wrote answers)."""
    n, device = len(prompts), batch.device
    logits = batch.prefill(prompts)  # (n, V)
    out = torch.full((n, max_new_tokens), -1, dtype=torch.long, device=device)  # (n, M) -1 = not written
    top = (torch.zeros(n, max_new_tokens, top_logprobs, dtype=torch.long, device=device),
           torch.zeros(n, max_new_tokens, top_logprobs, dtype=torch.float32, device=device)) if top_logprobs else None
    owner = torch.arange(n, device=device)  # (live,) the response each live row writes
    lengths = torch.tensor([len(ids) for ids in prompts])  # (n,) on the CPU
    live = run = n  # rows 0 .. live-1 hold answers; rows live .. run-1 run along, ignored
    longest, row_steps = int(lengths.max()), 0
    for step in range(max_new_tokens):
        chosen = logits[:live].argmax(-1) if sampling.greedy else sample(warp(logits[:live], sampling), generator)
        out[owner, step] = chosen  # (live,)
        if top is not None:
            best = torch.log_softmax(logits[:live].float(), -1).topk(top_logprobs, dim=-1)  # (live, k)
            top[0][owner, step], top[1][owner, step] = best.indices, best.values
        if step + 1 == max_new_tokens:
            break
        if (step + 1) % check_every == 0:
            keep = (out[owner, : step + 1] != eos).all(-1).nonzero()[:, 0]  # (m,) rows still answering
            if keep.numel() == 0:
                break
            if keep.numel() <= run // 2:
                batch.keep_rows(keep)
                owner, chosen, live = owner[keep], chosen[keep], keep.numel()
                run = min(run, 1 << (live - 1).bit_length())  # a power of two: few distinct shapes
                longest = int(lengths[owner.cpu()].max())
        fed = chosen if run == live else torch.cat([chosen, chosen.new_zeros(run - live)])  # (run,)
        logits = batch.decode(fed, run, longest + step + 1)  # (run, V)
        row_steps += run
    return _responses(out.cpu(), None if top is None else (top[0].cpu(), top[1].cpu()), eos), row_steps


def _responses(out: torch.Tensor, top: tuple[torch.Tensor, torch.Tensor] | None, eos: int) -> list[dict]:
    """Per row of ``out`` (n, M) (-1 where never written): ids up to and including the first EOS, the finish
    reason, and the top-k (R, k) of those positions."""
    responses = []
    for row, ids in enumerate(out.tolist()):
        length = ids.index(eos) + 1 if eos in ids else ids.index(-1) if -1 in ids else len(ids)
        response = {"ids": ids[:length], "finish_reason": "eos" if eos in ids[:length] else "length"}
        if top is not None:
            response |= {"top_ids": top[0][row, :length].tolist(), "top_logprobs": top[1][row, :length].tolist()}
        responses.append(response)
    return responses
