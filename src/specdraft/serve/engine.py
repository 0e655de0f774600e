"""The decoding engine behind the server: one thread runs :class:`~specdraft.batching.BatchDecoder` steps while
requests join and leave the batch between steps (continuous batching, Orca, Yu et al. 2022).

A request asks for ``n`` completions of one prompt; each is a sequence of its own (own drafter instance, own
generator seeded ``seed + i``). Sequences wait in a bounded queue until a row of the batch is free; a request that
would overflow the queue is refused (:class:`QueueFull`, HTTP 429). Tokens go back to the request's asyncio queue
after every step; a request whose client went away is marked cancelled and its sequences leave the batch before
the next step.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdraft.batching import BatchDecoder, BatchSequence, DraftGate
from specdraft.decoding import GenerationConfig
from specdraft.drafters.base import Drafter
from specdraft.errors import SpecdraftError
from specdraft.serve.metrics import Metrics

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The waiting queue cannot take the request's sequences."""


@dataclass
class Event:
    """What the engine tells a request: tokens of one choice (finish_reason set on its last event), or an error."""

    index: int = 0
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    status: int = 500


@dataclass
class Request:
    """``n`` completions of one prompt, with the asyncio queue their events go to."""

    prompt_ids: list[int]
    config: GenerationConfig
    n: int = 1
    seed: int | None = None
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    cancelled: bool = False
    completion_tokens: int = 0

    def generator(self, index: int) -> torch.Generator:
        generator = torch.Generator()
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed + index)
        return generator

    def emit(self, event: Event) -> None:
        if self.loop is not None and self.events is not None and not self.cancelled:
            try:
                self.loop.call_soon_threadsafe(self.events.put_nowait, event)
            except RuntimeError:  # the event loop has closed (shutdown): nobody is listening any more
                self.cancelled = True


class Engine:
    """Owns the target, the batch and the decoding thread."""

    def __init__(self, target, tokenizer, make_drafter: Callable[[], Drafter | None], max_batch: int,
                 capacity: int, max_queue: int, max_draft_batch: int = 0, online=None,
                 gate: DraftGate | None = None) -> None:
        """``online``: an :class:`~specdraft.serve.online.OnlineDistiller` (its drafters replace ``make_drafter``'s),
        or None; ``gate``: whether steps of several sequences draft, from measured tokens/s (None: always)."""
        self.decoder = BatchDecoder(target, max_batch, capacity, tokenizer, max_draft_batch, gate)
        self.make_drafter, self.max_queue, self.online = make_drafter, max_queue, online
        self.metrics = Metrics()
        if online is not None:
            self.make_drafter, self.decoder.on_verify = online.make_drafter, online.on_verify
            self.metrics.extra = online.metric_lines
        self._pending: collections.deque[tuple[Request, int]] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="specdraft-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()
        if self.online is not None:
            self.online.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the decoding thread; every waiting or running request ends with an error event."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.online is not None:
            self.online.stop()

    @property
    def queue_length(self) -> int:
        return len(self._pending)

    @property
    def running(self) -> int:
        return len(self.decoder.rows)

    def submit(self, request: Request) -> None:
        """Queue the request's ``n`` sequences, or raise :class:`QueueFull`."""
        with self._cond:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            room = self.max_queue + self.decoder.free_rows
            if len(self._pending) + request.n > room:
                raise QueueFull(f"queue full: {len(self._pending)} sequences are waiting (limit {self.max_queue})")
            self._pending.extend((request, i) for i in range(request.n))
            self.metrics.queue_length = len(self._pending)
            self._cond.notify_all()

    def cancel(self, request: Request) -> None:
        """The client went away: its sequences leave the batch before the next step."""
        request.cancelled = True
        with self._cond:
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._pending and not self.decoder.rows:
                    self._cond.wait()
                if self._stopping:
                    break
                admitted = [self._pending.popleft() for _ in range(min(len(self._pending), self.decoder.free_rows))]
                self.metrics.queue_length = len(self._pending)
            self._admit(admitted)
            self._drop_cancelled()
            if self.decoder.rows:
                self._step()
        self._fail_all("the server is shutting down", 503)

    def _admit(self, admitted: list[tuple[Request, int]]) -> None:
        for request, index in admitted:
            if request.cancelled:
                continue
            try:
                drafter = self.make_drafter()
                seq = self.decoder.add(request.prompt_ids, drafter, request.config, request.generator(index))
            except Exception as exc:  # a bad request must not stop the engine: it gets the error
                bad_input = isinstance(exc, SpecdraftError)
                if not bad_input:
                    log.exception("admitting a sequence failed")
                request.emit(Event(index, error=str(exc), status=400 if bad_input else 500))
                request.cancelled = True
                continue
            seq.tag = (request, index)
            self.metrics.prompt_tokens += len(request.prompt_ids)

    def _drop_cancelled(self) -> None:
        for seq in list(self.decoder.rows):
            if seq.tag[0].cancelled:
                self._remove(seq)
                self.metrics.cancelled += 1

    def _step(self) -> None:
        try:
            committed = self.decoder.step()
        except Exception as exc:  # a failing step must not take the server down: its requests get the error
            log.exception("decoding step failed")
            for seq in list(self.decoder.rows):
                seq.tag[0].emit(Event(seq.tag[1], error=f"decoding failed: {exc}", status=500))
                self._remove(seq)
            return
        now = time.monotonic()
        for seq, tokens in committed:
            request, index = seq.tag
            request.completion_tokens += len(tokens)
            request.emit(Event(index, tokens, seq.finish_reason))
            if seq.finish_reason is not None:
                self._finished(seq)
        self.metrics.record_step(now, sum(len(tokens) for _, tokens in committed), len(committed))

    def _remove(self, seq: BatchSequence) -> None:
        self.decoder.remove(seq)
        if self.online is not None:
            self.online.discard(seq)

    def _finished(self, seq: BatchSequence) -> None:
        if self.online is not None:
            try:
                self.online.finished(seq)
            except Exception:  # recording is best effort: serving goes on
                log.exception("recording a finished sequence for online distillation failed")
        stats = self.metrics
        stats.sequences_finished += 1
        stats.target_forward_calls += seq.stats.target_forward_calls
        stats.finished_tokens += seq.stats.new_tokens
        stats.draft_tokens_proposed += seq.stats.draft_tokens_proposed
        stats.draft_tokens_accepted += seq.stats.draft_tokens_accepted

    def _fail_all(self, message: str, status: int) -> None:
        with self._cond:
            waiting = list(self._pending)
            self._pending.clear()
        for request, index in waiting:
            request.emit(Event(index, error=message, status=status))
        for seq in list(self.decoder.rows):
            seq.tag[0].emit(Event(seq.tag[1], error=message, status=status))
            self._remove(seq)
