"""Server counters in the Prometheus text exposition format (version 0.0.4), in the project's glossary: block
efficiency τ = generated tokens / target forward calls (per sequence), acceptance rate = accepted / proposed
draft tokens."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

_WINDOW_S = 10.0  # tokens/s is measured over the last this many seconds of steps


@dataclass
class Metrics:
    """Counters written by the engine thread and the request handlers; read by ``/metrics``."""

    requests: collections.Counter = field(default_factory=collections.Counter)  # (endpoint, status) -> count
    stream_errors: collections.Counter = field(default_factory=collections.Counter)  # (endpoint, status) -> count
    prompt_tokens: int = 0
    completion_tokens: int = 0
    steps: int = 0
    step_rows: int = 0
    sequences_finished: int = 0
    cancelled: int = 0
    sequences_failed: int = 0
    target_forward_calls: int = 0
    finished_tokens: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    queue_length: int = 0
    running: int = 0
    extra: Callable[[], list[str]] | None = None  # more Prometheus lines (online distillation)
    _recent: collections.deque = field(default_factory=collections.deque)  # (time, tokens) of recent steps
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def count_stream_error(self, endpoint: str, status: int) -> None:
        """An error event sent in a stream (its response had already started with status 200)."""
        with self._lock:
            self.stream_errors[(endpoint, status)] += 1

    def record_step(self, now: float, tokens: int, rows: int) -> None:
        with self._lock:
            self.steps += 1
            self.step_rows += rows
            self.running = rows
            self.completion_tokens += tokens
            self._recent.append((now, tokens))
            while self._recent and self._recent[0][0] < now - _WINDOW_S:
                self._recent.popleft()

    def tokens_per_second(self, now: float) -> float:
        with self._lock:
            recent = [tokens for when, tokens in self._recent if when >= now - _WINDOW_S]
        return sum(recent) / _WINDOW_S

    def render(self, now: float, queue_length: int, running: int) -> str:
        """The Prometheus text page."""
        tau = self.finished_tokens / self.target_forward_calls if self.target_forward_calls else 0.0
        acceptance = self.draft_tokens_accepted / self.draft_tokens_proposed if self.draft_tokens_proposed else 0.0
        lines = ["# HELP specdraft_requests_total HTTP requests by endpoint and status code.",
                 "# TYPE specdraft_requests_total counter"]
        with self._lock:
            requests = sorted(self.requests.items())
        lines += [f'specdraft_requests_total{{endpoint="{e}",status="{s}"}} {c}' for (e, s), c in requests]
        lines += ["# HELP specdraft_stream_errors_total Error events sent in streams (after status 200), by status.",
                  "# TYPE specdraft_stream_errors_total counter"]
        with self._lock:
            stream_errors = sorted(self.stream_errors.items())
        lines += [f'specdraft_stream_errors_total{{endpoint="{e}",status="{s}"}} {c}' for (e, s), c in stream_errors]
        metrics = [
            ("prompt_tokens_total", "counter", "prompt tokens of admitted sequences", self.prompt_tokens),
            ("completion_tokens_total", "counter", "tokens generated", self.completion_tokens),
            ("decode_steps_total", "counter", "batched target forwards (draft-verify steps)", self.steps),
            ("sequences_finished_total", "counter", "sequences that finished", self.sequences_finished),
            ("sequences_cancelled_total", "counter", "sequences dropped after their client left", self.cancelled),
            ("sequences_failed_total", "counter", "sequences that failed alone (their batch went on)",
             self.sequences_failed),
            ("draft_tokens_proposed_total", "counter", "draft tokens proposed (finished sequences)",
             self.draft_tokens_proposed),
            ("draft_tokens_accepted_total", "counter", "draft tokens accepted (finished sequences)",
             self.draft_tokens_accepted),
            ("block_efficiency", "gauge", "tau: tokens per target forward per sequence (finished sequences)", tau),
            ("acceptance_rate", "gauge", "accepted / proposed draft tokens (finished sequences)", acceptance),
            ("queue_length", "gauge", "sequences waiting for a row of the batch", queue_length),
            ("running_sequences", "gauge", "sequences in the batch", running),
            ("batch_size_mean", "gauge", "mean sequences per step", self.step_rows / self.steps if self.steps else 0),
            ("tokens_per_second", "gauge", f"tokens generated per second over the last {_WINDOW_S:.0f} s",
             self.tokens_per_second(now)),
        ]
        for name, kind, help_text, value in metrics:
            lines += [f"# HELP specdraft_{name} {help_text}", f"# TYPE specdraft_{name} {kind}",
                      f"specdraft_{name} {value:g}" if isinstance(value, float) else f"specdraft_{name} {value}"]
        if self.extra is not None:
            lines += self.extra()
        return "\n".join(lines) + "\n"
