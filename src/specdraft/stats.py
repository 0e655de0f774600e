"""Per-generation statistics, in the project's glossary.

block efficiency τ = new tokens / target forward calls of the decoding steps (Leviathan et al. 2023's expected
tokens per step; the prompt's prefill, all of it but its last token, is a forward of its own before the first step,
timed as ``prefill_seconds`` and not counted as a step). Acceptance rate = accepted draft tokens / proposed draft
tokens. Acceptance per draft position i = P(draft token i accepted | tokens 0..i-1 accepted), the conditional rate
EAGLE reports. ``accept_lengths`` holds the tokens committed per target forward (Spec-Bench's field of that name);
``draft_length_counts[n]`` the steps that verified n draft tokens (the lengths a speculation policy chose).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specdraft.verification import VerifyResult


@dataclass
class GenerationStats:
    """Counters and a timing ledger (draft, verify, overhead) for one generation."""

    new_tokens: int = 0
    target_forward_calls: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    reached_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)
    draft_length_counts: list[int] = field(default_factory=list)  # [n]: steps that verified n draft tokens
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prompt_tokens_cached: int = 0  # the prompt's first tokens read from a kept cache, not fed (a prefix cache)

    def record_step(self, result: VerifyResult, committed: int, draft_s: float, verify_s: float) -> None:
        """Account one draft-verify step that committed ``committed`` tokens."""
        self.new_tokens += committed
        self.target_forward_calls += 1
        self.draft_tokens_proposed += result.num_draft_tokens
        self.draft_tokens_accepted += result.num_accepted
        reached = min(result.num_accepted + 1, result.positions)
        grow = result.positions - len(self.reached_per_position)
        if grow > 0:
            self.reached_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(reached):
            self.reached_per_position[i] += 1
            self.accepted_per_position[i] += int(i < result.num_accepted)
        self.accept_lengths.append(committed)
        verified = result.num_draft_tokens
        self.draft_length_counts += [0] * (verified + 1 - len(self.draft_length_counts))
        self.draft_length_counts[verified] += 1
        self.draft_seconds += draft_s
        self.verify_seconds += verify_s

    @property
    def block_efficiency(self) -> float:
        return self.new_tokens / self.target_forward_calls if self.target_forward_calls else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.draft_tokens_accepted / self.draft_tokens_proposed if self.draft_tokens_proposed else None

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [a / r for a, r in zip(self.accepted_per_position, self.reached_per_position, strict=True) if r]

    @property
    def overhead_seconds(self) -> float:
        return max(0.0, self.decode_seconds - self.prefill_seconds - self.draft_seconds - self.verify_seconds)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        """JSON-ready view (the keys of ``specdraft generate --json``)."""
        return {
            "new_tokens": self.new_tokens,
            "target_forward_calls": self.target_forward_calls,
            "block_efficiency": self.block_efficiency,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_rate_per_position": self.acceptance_rate_per_position,
            "draft_tokens_proposed": self.draft_tokens_proposed,
            "draft_tokens_accepted": self.draft_tokens_accepted,
            "accept_lengths": self.accept_lengths,
            "draft_length_counts": self.draft_length_counts,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "prefill_seconds": self.prefill_seconds,
            "prompt_tokens_cached": self.prompt_tokens_cached,
            "overhead_seconds": self.overhead_seconds,
            "decode_seconds": self.decode_seconds,
            "tokens_per_second": self.tokens_per_second,
        }


def add_counts(total: list[int], counts: Sequence[int]) -> None:
    """Add ``counts`` to ``total`` element-wise in place, growing ``total`` to the longer length (per-position
    counters of several sequences or answers)."""
    total += [0] * (len(counts) - len(total))
    for i, count in enumerate(counts):
        total[i] += count


def draft_lengths_line(acceptance: Sequence[float] | None, lengths: Sequence[int] | None) -> str:
    """What a speculation policy chose and how it went, in one line: "acceptance per position 0.71 / 0.52; drafts
    verified (tokens: share of steps) 0: 31%, 1: 40%, 2: 29%"; "" when neither was measured."""
    parts = []
    if acceptance:
        parts.append("acceptance per position " + " / ".join(f"{a:.2f}" for a in acceptance))
    steps = sum(lengths or ())
    if steps:
        parts.append("drafts verified (tokens: share of steps) " +
                     ", ".join(f"{n}: {100 * c / steps:.0f}%" for n, c in enumerate(lengths) if c))
    return "; ".join(parts)
