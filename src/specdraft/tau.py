"""Greedy speculative decoding replayed over a known answer: the steps it takes, hence its block efficiency τ,
without running the target (Leviathan et al. 2023; Spec-Bench's accept lengths).

Under greedy decoding the output is the target's greedy answer whatever the drafter, so every step is fixed by the
answer: a step that starts at answer position t accepts the leading draft tokens that spell the answer's next
tokens, ``accepted(t)``, and commits them with one token of the target's own (recovered, or bonus when the whole
draft is accepted), never past the answer's end; the next step starts after them. :func:`greedy_steps` is that
walk, the one simulation behind every offline τ of the package: the exact τ of a draft model on the target's greedy
answers (``greedy_tau@γ`` in training logs, :mod:`specdraft.training.objectives.tau`), the same for self-drafting
heads from their training unroll, and a drafter replayed over recorded answers (:mod:`specdraft.bench.replay`).
On the target's own greedy answer the walk is exact: decoding commits the same tokens per target forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

TAU = "greedy_tau"  # metric name: answer tokens / steps of the replayed walk, "greedy_tau@γ"
FIRST_ACCEPT = "greedy_first_accept"  # metric name: share of steps whose first draft token is accepted


def greedy_steps(accepted: Callable[[int], int], length: int) -> list[tuple[int, int]]:
    """(accepted draft tokens, committed tokens) of each step of greedy speculative decoding over an answer of
    ``length`` tokens.

    Args:
        accepted: t -> the draft tokens a step starting at answer position t gets accepted (those equal to the
            answer's tokens t, t + 1, ...: a property of the drafter, given the answer); counted at most up to the
            answer's end.
        length: the answer's tokens.
    Returns:
        One (a, c) per step in order: a accepted, c = min(a + 1, tokens left) committed; the c sum to ``length``.
    """
    steps, t = [], 0
    while t < length:
        left = length - t
        taken = min(max(accepted(t), 0), left)
        steps.append((taken, min(taken + 1, left)))
        t += steps[-1][1]
    return steps


def leading(hits: Sequence[bool], limit: int) -> int:
    """How many of ``hits`` are True before the first False, at most ``limit``: a chain's accepted length when
    ``hits[i]`` says its depth-(i + 1) token is the answer's."""
    count = 0
    while count < min(limit, len(hits)) and hits[count]:
        count += 1
    return count


def tally(steps: list[tuple[int, int]]) -> tuple[int, int, int]:
    """(tokens, steps, steps whose first draft token was accepted) of :func:`greedy_steps`' walk."""
    return sum(c for _, c in steps), len(steps), sum(a > 0 for a, _ in steps)


def metric(name: str, num_draft_tokens: int, suffix: str = "") -> str:
    """The logged name of an offline estimate at γ, e.g. ``greedy_tau@4`` (:data:`TAU`, :data:`FIRST_ACCEPT`)."""
    return f"{name}@{num_draft_tokens}{suffix}"


__all__ = ["FIRST_ACCEPT", "TAU", "greedy_steps", "leading", "metric", "tally"]
