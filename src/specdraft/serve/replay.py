"""The replay buffer of online distillation (Online Speculative Decoding, Liu et al. 2023, arXiv 2310.07177): the
contexts the server verified, with the target's top-k p at every verified position, on disk.

p comes from the verify forwards the server runs anyway (no extra target forward): after a row is verified, the
target's logits that chose its m accepted tokens and the next token (m + 1 rows) are reduced to their top-k
log-probabilities (:class:`VerifiedRecorder`). When a sequence finishes, its prompt, response, top-k and the
positions where the draft had a token that the target rejected (``missed``) become one record, in the format of
``specdraft distill-data`` with stored top-k (``prompt_token_ids``, ``response_token_ids``, ``top_ids``,
``top_logprobs``), so the training code reads it unchanged.

One record is one file ``rec-NNNNNNNNN.json``, written beside and renamed (a crash leaves no half record), and the
buffer keeps the newest ``max_records`` files (the oldest are deleted). Every ``heldout_every``-th record is held
back from training to evaluate candidates on recent traffic.
"""

from __future__ import annotations

import collections
import json
import re
import threading
from pathlib import Path

import torch

from specdraft.errors import SpecdraftError
from specdraft.files import write_text_atomic

_RECORD = re.compile(r"^rec-(\d{9})\.json$")


class ReplayBuffer:
    """Bounded on-disk records in ``folder``; safe to add from one thread while another reads."""

    def __init__(self, folder: str | Path, max_records: int, heldout_every: int) -> None:
        if max_records < 1 or heldout_every < 2:
            raise SpecdraftError(f"replay buffer: max_records must be >= 1 and heldout_every >= 2, got "
                                 f"{max_records}, {heldout_every}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob(".rec-*.tmp"):  # a write cut short by a crash
            stale.unlink(missing_ok=True)
        numbers = sorted(int(m.group(1)) for m in map(_RECORD.match, (p.name for p in self.folder.iterdir())) if m)
        self.max_records, self.heldout_every = max_records, heldout_every
        self._numbers = collections.deque(numbers)
        self._next = numbers[-1] + 1 if numbers else 0
        self._lock = threading.Lock()
        self._trim()

    def __len__(self) -> int:
        return len(self._numbers)

    def path(self, number: int) -> Path:
        return self.folder / f"rec-{number:09d}.json"

    def is_heldout(self, number: int) -> bool:
        return number % self.heldout_every == self.heldout_every - 1

    def add(self, record: dict) -> int:
        """Write ``record`` atomically as the newest; drop the oldest beyond ``max_records``. Returns its number."""
        with self._lock:
            number, self._next = self._next, self._next + 1
        write_text_atomic(self.path(number), json.dumps(record, separators=(",", ":")))
        with self._lock:
            self._numbers.append(number)
            self._trim()
        return number

    def _trim(self) -> None:
        while len(self._numbers) > self.max_records:
            self.path(self._numbers.popleft()).unlink(missing_ok=True)

    def records(self) -> tuple[list[dict], list[dict]]:
        """(training records, held-back records), oldest first."""
        with self._lock:
            numbers = list(self._numbers)
        train, heldout = [], []
        for number in numbers:
            try:
                record = json.loads(self.path(number).read_text())
            except FileNotFoundError:  # dropped by a concurrent add
                continue
            (heldout if self.is_heldout(number) else train).append(record)
        return train, heldout


class VerifiedRecorder:
    """Collects the target's top-k p at every verified position of each running sequence (the batch decoder's
    ``on_verify`` hook, in the decoding thread) and turns a finished sequence into a record."""

    def __init__(self, top_k: int) -> None:
        if top_k < 1:
            raise SpecdraftError(f"top_k must be >= 1, got {top_k}")
        self.top_k = top_k
        self._open: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], list[bool]]] = {}

    def on_verify(self, seq, p_logits: torch.Tensor, missed: bool) -> None:
        """``p_logits`` (m + 1, V): the target's logits at the step's committed positions; ``missed``: the draft
        had a token at the last of them, which the target rejected."""
        top = torch.log_softmax(p_logits.float(), dim=-1).topk(min(self.top_k, p_logits.shape[-1]))  # (m + 1, k)
        ids, logprobs, misses = self._open.setdefault(id(seq), ([], [], []))
        ids.append(top.indices)
        logprobs.append(top.values)
        misses += [False] * (p_logits.shape[0] - 1) + [missed]

    def discard(self, seq) -> None:
        self._open.pop(id(seq), None)

    def finish(self, seq, extra: dict | None = None) -> dict | None:
        """The record of a finished sequence (None if it generated nothing): positions beyond its committed tokens
        (a stop string cut the last step) are dropped, and so are committed tokens no forward verified (the stop
        token a grammar leaves as the only continuation, committed without a forward: its p, a point mass, was
        never seen), so the record ends before them."""
        ids, logprobs, misses = self._open.pop(id(seq), ([], [], []))
        if not seq.generated or not ids:
            return None
        top_ids, top_logprobs = torch.cat(ids)[: len(seq.generated)], torch.cat(logprobs)[: len(seq.generated)]
        length = top_ids.shape[0]  # (R, k) each: R positions verified and committed
        return {"prompt_token_ids": seq.prompt.tolist(), "response_token_ids": list(seq.generated[:length]),
                "top_ids": top_ids.tolist(), "top_logprobs": [[round(v, 4) for v in row] for row in
                                                               top_logprobs.tolist()],
                "missed": misses[:length]} | (extra or {})


__all__ = ["ReplayBuffer", "VerifiedRecorder"]
