"""Server counters in the Prometheus text exposition format (version 0.0.4), in the project's glossary: block
efficiency τ = generated tokens / target forward calls (per sequence), acceptance rate = accepted / proposed
draft tokens, acceptance at draft position i = accepted / reached there (a position is reached when every draft
token before it was accepted; positions count from 1), and the draft lengths verified per step (what the
speculation policy chose). Speculation counters are per drafter (label ``drafter``) as well as overall; each
request's own figures are a :class:`SpeculationTally` too (``usage.speculation`` of its response)."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from specdraft.stats import add_counts

_WINDOW_S = 10.0  # tokens/s is measured over the last this many seconds of steps


@dataclass
class SpeculationTally:
    """Speculation counters summed over sequences (:class:`~specdraft.stats.GenerationStats` of each)."""

    new_tokens: int = 0
    target_forward_calls: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    reached_per_position: list[int] = field(default_factory=list)  # [i]: steps whose draft reached position i + 1
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: ... and accepted its token there
    draft_length_counts: list[int] = field(default_factory=list)  # [n]: steps that verified n draft tokens

    def add(self, stats) -> None:
        """Add one sequence's :class:`~specdraft.stats.GenerationStats`."""
        self.new_tokens += stats.new_tokens
        self.target_forward_calls += stats.target_forward_calls
        self.draft_tokens_proposed += stats.draft_tokens_proposed
        self.draft_tokens_accepted += stats.draft_tokens_accepted
        for mine, theirs in ((self.reached_per_position, stats.reached_per_position),
                             (self.accepted_per_position, stats.accepted_per_position),
                             (self.draft_length_counts, stats.draft_length_counts)):
            add_counts(mine, theirs)

    @property
    def block_efficiency(self) -> float:
        return self.new_tokens / self.target_forward_calls if self.target_forward_calls else 0.0

    def to_dict(self) -> dict:
        """The JSON of ``usage.speculation``."""
        return {"target_forward_calls": self.target_forward_calls, "block_efficiency": self.block_efficiency,
                "draft_tokens_proposed": self.draft_tokens_proposed,
                "draft_tokens_accepted": self.draft_tokens_accepted,
                "reached_per_position": list(self.reached_per_position),
                "accepted_per_position": list(self.accepted_per_position),
                "acceptance_rate_per_position": [a / r if r else None for a, r in
                                                 zip(self.accepted_per_position, self.reached_per_position,
                                                     strict=True)],
                "draft_length_counts": list(self.draft_length_counts)}

    def lines(self, drafter: str) -> list[str]:
        """Prometheus samples of this tally under the label ``drafter``."""
        label = f'drafter="{_escape(drafter)}"'
        out = [f"specdraft_drafter_draft_tokens_proposed_total{{{label}}} {self.draft_tokens_proposed}",
               f"specdraft_drafter_draft_tokens_accepted_total{{{label}}} {self.draft_tokens_accepted}"]
        out += [f'specdraft_draft_position_reached_total{{{label},position="{i + 1}"}} {c}'
                for i, c in enumerate(self.reached_per_position)]
        out += [f'specdraft_draft_position_accepted_total{{{label},position="{i + 1}"}} {c}'
                for i, c in enumerate(self.accepted_per_position)]
        out += [f'specdraft_draft_length_steps_total{{{label},length="{n}"}} {c}'
                for n, c in enumerate(self.draft_length_counts) if c]
        return out


def _escape(value: str) -> str:
    """A Prometheus label value: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


_PER_DRAFTER = [  # (name, help) of the per-drafter families, in the order of SpeculationTally.lines
    ("drafter_draft_tokens_proposed_total", "draft tokens proposed, by drafter (finished sequences)"),
    ("drafter_draft_tokens_accepted_total", "draft tokens accepted, by drafter (finished sequences)"),
    ("draft_position_reached_total", "draft positions reached (every earlier draft token accepted), by drafter "
                                     "and position (from 1)"),
    ("draft_position_accepted_total", "draft tokens accepted at each position, by drafter and position (from 1)"),
    ("draft_length_steps_total", "steps that verified a draft of each length, by drafter (0: a plain step)"),
]


@dataclass
class Metrics:
    """Counters written by the engine thread and the request handlers; read by ``/metrics``."""

    requests: collections.Counter = field(default_factory=collections.Counter)  # (endpoint, status) -> count
    stream_errors: collections.Counter = field(default_factory=collections.Counter)  # (endpoint, status) -> count
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
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
    per_drafter: dict[str, SpeculationTally] = field(default_factory=dict)  # drafter name -> its counters
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

    def record_finished(self, drafter: str, stats) -> None:
        """A finished sequence's :class:`~specdraft.stats.GenerationStats`, drafted by ``drafter``."""
        with self._lock:
            self.sequences_finished += 1
            self.target_forward_calls += stats.target_forward_calls
            self.finished_tokens += stats.new_tokens
            self.draft_tokens_proposed += stats.draft_tokens_proposed
            self.draft_tokens_accepted += stats.draft_tokens_accepted
            self.per_drafter.setdefault(drafter, SpeculationTally()).add(stats)

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
            ("prompt_tokens_cached_total", "counter", "of those, read from a kept cache (prefix caching), not fed",
             self.prompt_tokens_cached),
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
        with self._lock:
            samples = [tally.lines(name) for name, tally in sorted(self.per_drafter.items())]
        for name, help_text in _PER_DRAFTER:
            lines += [f"# HELP specdraft_{name} {help_text}",
                      f"# TYPE specdraft_{name} counter"]
            lines += [line for drafter in samples for line in drafter if line.startswith(f"specdraft_{name}{{")]
        if self.extra is not None:
            lines += self.extra()
        return "\n".join(lines) + "\n"
