"""When to stop: EOS, stop strings and max_new_tokens, honoured inside a verified block so that nothing is emitted
past EOS or a stop string and never more than ``max_new_tokens``."""

from __future__ import annotations

from collections.abc import Sequence


class Stopper:
    """Scans tokens as they are committed and says how many of them to keep."""

    def __init__(
        self,
        max_new_tokens: int,
        eos_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        tokenizer=None,
    ) -> None:
        if stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.max_new_tokens = max_new_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_strings = tuple(stop_strings)
        self.tokenizer = tokenizer
        self._tail = 8 + max((len(s) for s in self.stop_strings), default=0)  # tokens of left context to decode

    def scan(self, generated: list[int], new: list[int]) -> tuple[int, str | None]:
        """How many of ``new`` to append to ``generated``, and why generation ends (None if it goes on).

        Returns ``(keep, reason)`` with reason one of "eos", "stop", "length" or None.
        """
        room = self.max_new_tokens - len(generated)
        for i, token in enumerate(new[:room]):
            if token in self.eos_token_ids:
                return i + 1, "eos"
            if self.stop_strings and self._completes_stop_string(generated + new[:i], token):
                return i + 1, "stop"
        keep = min(len(new), room)
        return keep, "length" if len(generated) + keep >= self.max_new_tokens else None

    def _completes_stop_string(self, before: list[int], token: int) -> bool:
        tail = before[-self._tail :]
        text_before = self.tokenizer.decode(tail)
        text_after = self.tokenizer.decode(tail + [token])
        return any(s in text_after and s not in text_before for s in self.stop_strings)
