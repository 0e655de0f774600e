"""Draft models of many sequences run their forwards together (lockstep drafting for batched decoding).

Every sequence of a batch has its own drafter instance, and a draft-model drafter runs one small forward per draft
token. Run one after another, those forwards cost the batch size times a batch-1 draft forward per draft token;
here they are batched without changing the drafter's code: each drafter instance gets a :class:`DraftModelProxy`
in place of its model, whose cache is one row of a shared :class:`~specdraft.models.batched_llama.BatchedKVCache`
and whose ``forward`` hands the request to a :class:`DraftBatcher`. :meth:`DraftBatcher.run` calls every drafter's
``propose`` in a thread of its own; whenever every drafter still drafting is waiting on a forward, the batcher runs
them all as one ragged batched forward and hands each its logits. A draft then depends only on its own sequence
(each row sees its own cache), so verification stays lossless, whatever the batch.

Only causal forwards are batched; a forward with explicit positions or a mask (a draft tree's expansion) raises,
so tree-mode drafters keep their own model (:func:`lockstep_factory` leaves them as they are).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from specdraft.drafters.base import Draft, Drafter
from specdraft.drafters.combined import draft_model_of
from specdraft.errors import SpecdraftError
from specdraft.hardware import openmp_alone
from specdraft.models.batched_llama import batched_forward, new_batched_cache, supports_batching

_LONG = 8  # a forward of more tokens than this (a prompt's first sync) runs apart from the one-token steps


class _RowCache:
    """One drafter's row of the shared cache, seen as a batch-1 KV cache; the row is freed with this object."""

    def __init__(self, batcher: DraftBatcher) -> None:
        self.batcher, self.row = batcher, batcher.allocate()
        self.batcher.cache.lengths[self.row] = 0
        weakref.finalize(self, batcher.release, self.row)

    @property
    def length(self) -> int:
        return self.batcher.cache.lengths[self.row]

    @property
    def capacity(self) -> int:
        return self.batcher.cache.capacity

    def crop(self, length: int) -> None:
        self.batcher.cache.crop(self.row, length)

    def compact(self, start: int, slots: list[int]) -> None:
        self.batcher.cache.compact(self.row, start, slots)


class DraftModelProxy:
    """Stands in for a native draft model inside one drafter instance: same attributes, batched forwards."""

    def __init__(self, model, batcher: DraftBatcher) -> None:
        self.model, self.batcher = model, batcher
        self.name, self.vocab_size, self.max_context = model.name, model.vocab_size, model.max_context
        self.dtype, self.config, self.lm_head_weight = model.dtype, model.config, model.lm_head_weight

    def new_cache(self, capacity: int, batch_size: int = 1) -> _RowCache:
        """A row of the shared cache, whatever ``capacity`` asks: its real capacity is the shared rows'."""
        if batch_size != 1:
            raise SpecdraftError("lockstep drafting: a drafter's draft cache holds one sequence")
        return _RowCache(self.batcher)

    def forward(self, input_ids: torch.Tensor, cache: _RowCache, positions=None, attention_mask=None,
                return_hidden: bool = False, logits_weight: torch.Tensor | None = None, logits_to_keep: int = 0):
        """(1, T) ids on the drafter's row -> (1, T or k, V) float32 logits, computed in a batch with the others."""
        if positions is not None or attention_mask is not None or return_hidden:
            raise SpecdraftError("lockstep drafting batches causal draft forwards only (no tree expansion)")
        keep = logits_to_keep if logits_to_keep > 0 else input_ids.shape[1]
        return self.batcher.submit(_Request(cache.row, input_ids[0], keep, logits_weight))


@dataclass
class _Request:
    row: int
    ids: torch.Tensor  # (T,)
    keep: int  # logits of the last ``keep`` tokens
    weight: torch.Tensor | None
    done: threading.Event = field(default_factory=threading.Event)
    logits: torch.Tensor | None = None
    error: BaseException | None = None


class DraftBatcher:
    """Owns the draft model's shared cache and batches the forwards of the drafters running in :meth:`run`."""

    def __init__(self, model, max_rows: int, capacity: int) -> None:
        self.model = model
        self.cache = new_batched_cache(model, max_rows, capacity)
        self._free = list(range(max_rows - 1, -1, -1))
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._pending: list[_Request] = []
        self._running = 0
        # the drafters' threads run their Python and small tensor work; the forwards run in the caller's thread,
        # so they keep no OpenMP workers of their own (which would slow every parallel region there)
        self._pool = ThreadPoolExecutor(max_workers=max_rows, thread_name_prefix="specdraft-draft",
                                        initializer=openmp_alone)

    def allocate(self) -> int:
        with self._lock:
            if not self._free:
                raise SpecdraftError(f"lockstep drafting: all {self.cache.max_rows} draft cache rows are in use")
            return self._free.pop()

    def release(self, row: int) -> None:
        with self._lock:
            self._free.append(row)

    def submit(self, request: _Request) -> torch.Tensor:
        """From a drafter's thread inside :meth:`run`: wait for the batched forward. Outside it: run at once."""
        with self._cond:
            inside = self._running > 0
            if inside:
                self._pending.append(request)
                self._cond.notify_all()
        if not inside:
            self._execute([request])
        else:
            request.done.wait()
        if request.error is not None:
            raise request.error
        return request.logits

    def run(self, tasks: list[Callable[[], Draft]]) -> list[Draft]:
        """Call every task (a drafter's ``propose``) in its own thread, batching their draft forwards."""
        with self._cond:
            self._running = len(tasks)
        futures = [self._pool.submit(self._task, task) for task in tasks]
        while True:
            with self._cond:
                while self._running and len(self._pending) < self._running:
                    self._cond.wait()
                if not self._running:
                    break
                batch, self._pending = self._pending, []
            self._execute(batch)
        return [future.result() for future in futures]

    def _task(self, task: Callable[[], Draft]) -> Draft:
        try:
            return task()
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def _execute(self, requests: list[_Request]) -> None:
        """Long feeds one by one, the rest in groups of the same LM head, each group as one ragged forward."""
        groups: dict[tuple, list[_Request]] = {}
        for request in requests:
            long = request.ids.shape[0] > _LONG and len(requests) > 1
            groups.setdefault(("long", id(request)) if long else ("short", id(request.weight)), []).append(request)
        for group in groups.values():
            try:
                self._forward(group)
            except BaseException as exc:  # the drafters' threads re-raise it
                for request in group:
                    request.error = exc
            for request in group:
                request.done.set()

    @torch.inference_mode()
    def _forward(self, group: list[_Request]) -> None:
        sizes = [r.ids.shape[0] for r in group]
        ids = torch.zeros(len(group), max(sizes), dtype=torch.long)  # (n, T), right-padded
        for i, request in enumerate(group):
            ids[i, : sizes[i]] = request.ids
        last = all(r.keep == 1 for r in group)
        logits = batched_forward(self.model, self.cache, ids, sizes, [r.row for r in group], last_only=last,
                                 logits_weight=group[0].weight)  # (n, 1 or T, V)
        for i, request in enumerate(group):
            rows = logits[i] if last else logits[i, sizes[i] - request.keep : sizes[i]]
            request.logits = rows.unsqueeze(0)  # (1, k, V)


def lockstep_factory(prototype: Drafter | None, max_rows: int, capacity: int,
                     fallback: Callable[[], Drafter | None]) -> Callable[[], Drafter | None]:
    """Fresh drafters for new sequences whose native draft model runs in lockstep (a shared batcher), when the
    prototype drafts (alone or combined, :func:`~specdraft.drafters.combined.draft_model_of`) with a batchable draft
    model in chain mode; else ``fallback`` (plain copies)."""
    base = draft_model_of(prototype)
    if base is None or not supports_batching(base.model) or base.tree_branching:
        return fallback
    model = base.model
    batcher = DraftBatcher(model, max_rows, capacity)

    def make() -> Drafter:
        drafter = fallback()
        # its cache, made on first use, is a row of the batcher's
        draft_model_of(drafter).model = DraftModelProxy(model, batcher)
        return drafter

    return make


def batcher_of(drafter: Drafter) -> DraftBatcher | None:
    """The lockstep batcher a drafter's forwards go through, if any."""
    base = draft_model_of(drafter)
    return base.model.batcher if base is not None and isinstance(base.model, DraftModelProxy) else None


__all__ = ["DraftBatcher", "DraftModelProxy", "batcher_of", "lockstep_factory"]
