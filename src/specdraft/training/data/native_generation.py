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
from specdraft.sampling import SamplingConfig, sample, sample_on_device, warp


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
    of ``distill-data --engine native`` on CUDA; with ``refill`` a call takes a whole shard and decodes it in
    ``rows`` rows, ended rows taking waiting prompts (:func:`generate_rows_static`)."""

    def __init__(self, model, graphs: bool = True, refill: bool = False) -> None:
        self.model, self.graphs, self.refill, self.batch = model, graphs, refill, None
        self.row_steps = 0  # rows decoded, summed over every decode step so far (live or running along)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig, eos: int,
                 top_logprobs: int, generator: torch.Generator | None, rows: int | None = None) -> list[dict]:
        """As :func:`generate_rows` (``generator`` on the model's device); ``rows``: the batch's rows under
        ``refill`` (default: one per prompt)."""
        rows = len(prompts) if rows is None or not self.refill else min(rows, len(prompts))
        batch = self._batch(rows, max(len(ids) for ids in prompts) + max_new_tokens)
        responses, row_steps = generate_rows_static(batch, prompts, max_new_tokens, sampling, eos, top_logprobs,
                                                    generator, rows=rows)
        self.row_steps += row_steps
        return responses

    def _batch(self, rows: int, capacity: int):
        """The kept batch, or a new one when it has fewer rows or slots than asked."""
        from specdraft.models.static_batch import StaticBatch

        if self.batch is None or self.batch.rows < rows or self.batch.capacity < capacity:
            rows = max(rows, self.batch.rows if self.batch is not None else 0)
            self.batch = None  # its cache is freed before the new one is allocated
            if self.model.embed_weight.device.type == "cuda":
                torch.cuda.empty_cache()
            capacity = min(self.model.max_context, -(-capacity // 256) * 256)  # fewer reallocations
            self.batch = StaticBatch(self.model, rows, capacity, self.graphs)
        return self.batch


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


class _Rows:
    """The bookkeeping of :func:`generate_rows_static`: which response each of the ``run`` decoded rows writes
    (``owner``, -1 when idle) and the step of its first token (``start``), on the device and mirrored on the host
    (read at checks only: no host sync per token)."""

    def __init__(self, batch, prompts: list[list[int]], max_new_tokens: int, rows: int) -> None:
        self.batch, self.prompts, self.max_new_tokens = batch, prompts, max_new_tokens
        self.run = min(rows, len(prompts))
        self.owner = list(range(self.run))  # host: response of each running row, -1 idle
        self.start = [0] * self.run  # host: step at which each row chose its first token
        self.waiting = self.run  # the next prompt to start
        self.device_state()

    def device_state(self) -> None:
        self.owner_t = torch.tensor(self.owner, device=self.batch.device)  # (run,)
        self.start_t = torch.tensor(self.start, device=self.batch.device)  # (run,)
        live = [row for row, o in enumerate(self.owner) if o >= 0]
        # the furthest slot a live row writes at step t is plen - start + t: the decode attends up to it
        self.reach = max((len(self.prompts[self.owner[r]]) - self.start[r] for r in live), default=0)
        # the steps at which a live row chooses its last allowed token (it must be checked then)
        self.deadlines = {self.start[r] + self.max_new_tokens - 1 for r in live}

    def end(self, ended: list[int]) -> None:
        for row in ended:
            self.owner[row] = -1

    def compact(self) -> torch.Tensor | None:
        """Once no prompt waits and at most half of the running rows are live: the live rows to keep, moved to the
        front of the batch (a power of two of rows runs on, the rest idle); None otherwise."""
        live = [row for row, o in enumerate(self.owner) if o >= 0]
        if self.waiting < len(self.prompts) or not live or len(live) > self.run // 2:
            return None
        keep = torch.tensor(live, device=self.batch.device)  # (m,)
        self.batch.keep_rows(keep)
        self.run = min(self.run, 1 << (len(live) - 1).bit_length())
        pad = self.run - len(live)
        self.owner, self.start = [self.owner[r] for r in live] + [-1] * pad, [self.start[r] for r in live] + [0] * pad
        return keep

    def refill(self, step: int) -> tuple[list[int], torch.Tensor | None]:
        """Start waiting prompts on idle rows (their first token is chosen at ``step``): the rows and the prefill's
        logits (k, V); idle rows left over get position 0 (they run along; their writes stay in slot 0)."""
        idle = [row for row, o in enumerate(self.owner) if o < 0]
        take = idle[: len(self.prompts) - self.waiting]
        logits = None
        if take:
            index = range(self.waiting, self.waiting + len(take))
            logits = self.batch.prefill([self.prompts[i] for i in index], take)  # (k, V)
            for row, i in zip(take, index, strict=True):
                self.owner[row], self.start[row] = i, step
            self.waiting += len(take)
        rest = idle[len(take):]
        if rest:
            self.batch.positions[torch.tensor(rest, device=self.batch.device)] = 0
        return take, logits


@torch.inference_mode()
def generate_rows_static(batch, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig, eos: int,
                         top_logprobs: int, generator: torch.Generator | None, check_every: int = 16,
                         rows: int | None = None) -> tuple[list[dict], int]:
    """:func:`generate_rows` in a static batch of ``rows`` rows (default: all of the batch's), for any number of
    prompts (sorted by length, ideally). Every row decodes each step (no host sync per token). Every
    ``check_every`` steps, and when a row reaches the length cap, the rows that ended are found: while prompts wait,
    such a row takes the next one, prefilled into that row while the others keep decoding (no row runs along idle
    while prompts wait); once none waits and at most half of the rows still answer, those move to the front and a
    smaller batch runs on; the loop ends when none is left. Returns the responses and the rows decoded over all
    steps (answer tokens / that = the share of the decode work that wrote answers)."""
    n, device = len(prompts), batch.device
    state = _Rows(batch, prompts, max_new_tokens, min(rows or batch.rows, batch.rows))
    logits = batch.prefill(prompts[: state.run])  # (run, V)
    # (n + 1, M): -1 = not written; idle rows write into the spare last row (no data-dependent shapes: no host sync)
    out = torch.full((n + 1, max_new_tokens), -1, dtype=torch.long, device=device)
    shape = (n + 1, max_new_tokens, top_logprobs)
    top = (torch.zeros(shape, dtype=torch.long, device=device),
           torch.zeros(shape, dtype=torch.float32, device=device)) if top_logprobs else None
    step, row_steps = 0, 0
    while True:
        run = state.run
        chosen = (logits[:run].argmax(-1) if sampling.greedy  # (run,); no host read (sample_on_device)
                  else sample_on_device(warp(logits[:run], sampling), generator))
        live = state.owner_t >= 0  # (run,)
        owner = torch.where(live, state.owner_t, n)  # (run,) the spare row n for idle rows
        index = (step - state.start_t).clamp(0, max_new_tokens - 1)  # (run,)
        out[owner, index] = chosen
        if top is not None:
            best = torch.log_softmax(logits[:run].float(), -1).topk(top_logprobs, dim=-1)  # (run, k)
            top[0][owner, index], top[1][owner, index] = best.indices, best.values
        check = (step + 1) % check_every == 0 or step in state.deadlines
        if check:
            ended = live & ((out[state.owner_t.clamp_min(0)] == eos).any(-1)
                            | (step - state.start_t + 1 >= max_new_tokens))  # (run,)
            state.end(ended.nonzero()[:, 0].tolist())
            if all(o < 0 for o in state.owner) and state.waiting == n:
                break
            keep = state.compact()
            if keep is not None:
                chosen = chosen[keep]
        pad = state.run - chosen.shape[0]
        fed = chosen if pad == 0 else torch.cat([chosen, chosen.new_zeros(pad)])  # (run,)
        logits = batch.decode(fed, state.run, state.reach + step + 1)  # (run, V)
        row_steps += state.run
        if check:
            rows, fresh = state.refill(step + 1)
            if rows:
                logits[torch.tensor(rows, device=device)] = fresh
            state.device_state()
        step += 1
    return _responses(out[:n].cpu(), None if top is None else (top[0][:n].cpu(), top[1][:n].cpu()), eos), row_steps
