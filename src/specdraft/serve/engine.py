"""The decoding engine behind the server: one thread runs :class:`~specdraft.batching.BatchDecoder` steps while
requests join and leave the batch between steps (continuous batching, Orca, Yu et al. 2022).

A request asks for ``n`` completions of one prompt; each is a sequence of its own (own drafter instance, own
generator seeded ``seed + i``). Sequences wait in a bounded queue until a row of the batch is free; a request that
would overflow the queue is refused (:class:`QueueFull`, HTTP 429). Tokens go back to the request's asyncio queue
after every step; a request whose client went away is marked cancelled and its sequences leave the batch before
the next step. A sequence that fails on its own (:attr:`~specdraft.sequence.SequenceState.error`) ends its request
with an error event; the other sequences of the batch go on unaffected.

Log-probabilities (``Request.logprobs``): for each emitted token, its log-probability under the distribution the
target drew it from, the request's warped p (temperature, top-k, top-p) at that position, from the logits of the
verify forward that chose it (no extra forward); greedy requests, whose warped p is a point mass, get the raw
log-softmax (temperature 1, no top-k or top-p) instead.
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

from specdraft.batching import BatchDecoder
from specdraft.drafters.base import Drafter
from specdraft.errors import SpecdraftError
from specdraft.hardware import release_openmp_workers
from specdraft.sampling import SamplingConfig, warp
from specdraft.sequence import GenerationConfig, SequenceState
from specdraft.serve.metrics import Metrics, SpeculationTally

log = logging.getLogger(__name__)

LOGPROB_FLOOR = -9999.0  # reported for a token the warping excluded (log 0), as OpenAI does; JSON has no -inf


class QueueFull(Exception):
    """The waiting queue cannot take the request's sequences."""


@dataclass
class Event:
    """What the engine tells a request: tokens of one choice (finish_reason set on its last event), or an error.
    ``logprobs``: per token, (its log-probability, [(alternative id, log-probability)] most likely first)."""

    index: int = 0
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    status: int = 500
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass(eq=False)
class Request:
    """``n`` completions of one prompt, with the asyncio queue their events go to (compared by identity)."""

    prompt_ids: list[int]
    config: GenerationConfig
    n: int = 1
    seed: int | None = None
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    cancelled: bool = False
    completion_tokens: int = 0
    logprobs: int | None = None  # None: no log-probabilities; k: each token's, with its k most likely alternatives
    speculation: SpeculationTally = field(default_factory=SpeculationTally)  # its finished sequences' counters
    closed_at_budget: int = 0  # its answers that the grammar closed early to keep them complete within max_tokens
    prompt_tokens_cached: int = 0  # its prompt's first tokens read from a kept cache (the first choice's)

    def generator(self, index: int) -> torch.Generator:
        """Choice ``index``'s generator: seeded ``(seed + index) mod 2**64`` (torch's seed range), else at random."""
        generator = torch.Generator()
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed((self.seed + index) % 2**64)
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
                 capacity: int, max_queue: int, online=None, prefix_cache: bool = True) -> None:
        """``online``: an :class:`~specdraft.serve.online.OnlineDistiller` (its drafters replace ``make_drafter``'s),
        or None. How much each sequence drafts is its request's ``config`` (speculation, γ, max_draft_batch).
        ``prefix_cache``: a prompt reads the positions it shares with a running or finished sequence's cache, where
        the target reads a prefix exactly (:class:`~specdraft.batching.BatchDecoder`)."""
        self.decoder = BatchDecoder(target, max_batch, capacity, tokenizer, prefix_cache)
        self.make_drafter, self.max_queue, self.online = make_drafter, max_queue, online
        self.metrics = Metrics()
        if online is not None:
            self.make_drafter = online.make_drafter
            self.metrics.extra = online.metric_lines
        self._logp: dict[int, torch.Tensor] = {}  # id(sequence) -> (m + 1, V) log p of its last step's positions
        self._pending: collections.deque[tuple[Request, int]] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="specdraft-engine", daemon=True)

    def start(self) -> None:
        """Start the decoding thread. The calling thread's OpenMP workers are let go first
        (:func:`~specdraft.hardware.release_openmp_workers`): with them idle beside the decoding thread's own, every
        parallel region of a step would wait for a sleeping worker to wake."""
        release_openmp_workers()
        self._thread.start()
        if self.online is not None:
            self.online.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the decoding thread (waiting at most ``timeout`` s for its step to end, as long again for the online
        trainer); every waiting or running request ends with an error event."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.online is not None:
            self.online.stop(timeout)

    @property
    def vocab_size(self) -> int:
        return self.decoder.target.vocab_size

    @property
    def context(self) -> int:
        """Most positions of one sequence: prompt and generated tokens."""
        return self.decoder.capacity

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
            self.metrics.prompt_tokens_cached += seq.stats.prompt_tokens_cached
            if index == 0:
                request.prompt_tokens_cached = seq.stats.prompt_tokens_cached

    def _drop_cancelled(self) -> None:
        for seq in list(self.decoder.rows):
            if seq.tag[0].cancelled:
                self._remove(seq)
                self.metrics.cancelled += 1

    def _step(self) -> None:
        wants = self.online is not None or any(seq.tag[0].logprobs is not None for seq in self.decoder.rows)
        self.decoder.on_verify = self._on_verify if wants else None  # the hook costs a copy of p: only when used
        try:
            committed = self.decoder.step()
        except Exception as exc:  # a failing step must not take the server down: its requests get the error
            log.exception("decoding step failed")
            for seq in list(self.decoder.rows):
                seq.tag[0].emit(Event(seq.tag[1], error=f"decoding failed: {exc}", status=500))
                self._remove(seq, keep=False)
            return
        now = time.monotonic()
        for seq, tokens in committed:
            request, index = seq.tag
            if seq.error is not None:
                self._failed(seq)
                continue
            request.completion_tokens += len(tokens)
            if seq.finish_reason is not None:  # counted before the last event: the answer's usage reads it
                request.speculation.add(seq.stats)
                request.closed_at_budget += seq.closed_at_budget()
            request.emit(Event(index, tokens, seq.finish_reason, logprobs=self._token_logprobs(seq, tokens)))
            if seq.finish_reason is not None:
                self._finished(seq)
        self.metrics.record_step(now, sum(len(tokens) for _, tokens in committed), len(committed))

    def _on_verify(self, seq: SequenceState, p_logits: torch.Tensor, missed: bool, proposed: int) -> None:
        """The decoder's hook after each row's verification: online distillation's recorder, and the log p of the
        positions that chose the row's tokens when its request asked for log-probabilities."""
        if self.online is not None:
            self.online.on_verify(seq, p_logits, missed, proposed)
        if seq.tag[0].logprobs is not None:
            self._logp[id(seq)] = log_probs(p_logits, seq.config.sampling)  # (m + 1, V)

    def _token_logprobs(self, seq: SequenceState, tokens: list[int]):
        logp = self._logp.pop(id(seq), None)
        if logp is None or not tokens:
            return None
        top = seq.tag[0].logprobs
        if len(tokens) > logp.shape[0]:  # a stop token committed without a forward: p there is a point mass on it
            certain = torch.full((len(tokens) - logp.shape[0], logp.shape[1]), float("-inf"))  # (extra, V)
            certain[torch.arange(certain.shape[0]), torch.tensor(tokens[logp.shape[0]:])] = 0.0
            logp = torch.cat([logp, certain])  # (k, V)
        chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()  # (k,)
        best = logp[: len(tokens)].topk(top) if top else None  # (k, top)
        return [(max(value, LOGPROB_FLOOR),
                 [] if best is None else [(int(i), max(float(v), LOGPROB_FLOOR))
                                          for i, v in zip(best.indices[row], best.values[row], strict=True)])
                for row, value in enumerate(chosen)]

    def _failed(self, seq: SequenceState) -> None:
        """A sequence that failed alone (the decoder already took it out of the batch): its request gets the error,
        400 when the error names bad input, else 500 (logged: a server-side failure)."""
        request, index = seq.tag
        bad_input = isinstance(seq.error, SpecdraftError)
        if not bad_input:
            log.error("a sequence failed alone", exc_info=seq.error)
        request.emit(Event(index, error=f"decoding failed: {seq.error}", status=400 if bad_input else 500))
        request.cancelled = True
        self.metrics.sequences_failed += 1
        self._logp.pop(id(seq), None)
        if self.online is not None:
            self.online.discard(seq)

    def _remove(self, seq: SequenceState, keep: bool = True) -> None:
        self.decoder.remove(seq, keep)
        self._logp.pop(id(seq), None)
        if self.online is not None:
            self.online.discard(seq)

    def _finished(self, seq: SequenceState) -> None:
        if self.online is not None:
            try:
                self.online.finished(seq)
            except Exception:  # recording is best effort: serving goes on
                log.exception("recording a finished sequence for online distillation failed")
        self.metrics.record_finished(seq.drafter.name, seq.stats)

    def _fail_all(self, message: str, status: int) -> None:
        with self._cond:
            waiting = list(self._pending)
            self._pending.clear()
        for request, index in waiting:
            request.emit(Event(index, error=message, status=status))
        for seq in list(self.decoder.rows):
            seq.tag[0].emit(Event(seq.tag[1], error=message, status=status))
            self._remove(seq)


def log_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Log-probabilities (..., V) of the distribution each token is drawn from: log of the warped p
    (:func:`~specdraft.sampling.warp`: temperature, top-k, top-p; -inf where warping excluded a token); for greedy
    decoding, whose warped p is a point mass, the raw log-softmax (temperature 1, no top-k or top-p)."""
    if sampling.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    return torch.log(warp(logits, sampling))
