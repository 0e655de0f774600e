"""N-gram drafts from the target's own answers, beside prompt lookup: a static n-gram model of what the target
writes, looked up with backoff, and copies from the context where the context repeats itself.

The table (:class:`NGramTable`, built once by ``specdraft build-ngram`` from the target's greedy answers to many
prompts) maps every n-gram (n = 1 .. ``max_order``) that precedes some answer token at least ``min_count`` times to
its most frequent successor and that successor's share of its occurrences. A draft follows, token by token, the
longest n-gram ending the context that the table holds (backoff without smoothing, as the "stupid backoff" of
Brants et al. 2007 without its scores); where the context itself holds an earlier occurrence of its last
``prompt_lookup_min`` or more tokens, the prompt-lookup copy (Saxena 2023) is drafted instead. Related:
Lookahead's n-gram pool (Fu et al. 2024) and Token Recycling (Luo et al. 2024), which learn their n-grams while
decoding; here they come from the target's answers to other prompts. Deterministic (q = None), so lossless.

A table node carries its successor's share as ``Draft.confidence`` and its n-gram order as ``Draft.source`` (10 +
n; a prompt-lookup copy: its matched size), so adaptive speculation learns the worth of each apart.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

from specdraft.compat import tokenizer_fingerprint
from specdraft.drafters.base import EMPTY_DRAFT, Draft, DrafterFacts
from specdraft.drafters.options import build
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.errors import SpecdraftError
from specdraft.files import write_text_atomic
from specdraft.models.registry import default_ngram, resolve_ngram
from specdraft.sampling import SamplingConfig
from specdraft.verification import VerifyResult

FORMAT = "specdraft-ngram"
TABLE_FILE = "ngram.safetensors"
MANIFEST_FILE = "manifest.json"
_PRIME, _MASK = 0x100000001B3, (1 << 64) - 1  # FNV-1a's 64-bit prime: keys mix the order and each token id in turn
_MULTIPLIER = np.uint64(_PRIME)
_SOURCE_BASE = 10  # Draft.source of a table node: 10 + its n-gram order (prompt-lookup copies: 1 .. 3)


def _keys(windows: np.ndarray) -> np.ndarray:
    """(N, n) token ids -> (N,) uint64 keys of those n-grams (the order n mixed in first; wraps modulo 2^64)."""
    n = windows.shape[1]
    keys = np.full(windows.shape[0], n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for column in range(n):
            keys = keys * _MULTIPLIER + (windows[:, column].astype(np.uint64) + np.uint64(1))
    return keys


def _key(tokens: list[int]) -> int:
    """The key of one n-gram, as :func:`_keys` computes it (in Python ints: a few microseconds)."""
    key = len(tokens)
    for token in tokens:
        key = (key * _PRIME + token + 1) & _MASK
    return key


@dataclass(frozen=True)
class NGramTable:
    """Sorted n-gram keys with each one's most frequent successor and that successor's share.

    keys: (E,) uint64, sorted, unique; successors: (E,) token ids; shares: (E,) in (0, 1]. Saved as uint16 ids (int32
    for a vocabulary past 65,536) and float16 shares.
    """

    keys: np.ndarray
    successors: np.ndarray
    shares: np.ndarray
    max_order: int
    manifest: dict

    def __deepcopy__(self, memo: dict) -> NGramTable:
        return self  # immutable: every copy of a drafter (one a sequence when batching) shares it

    def lookup(self, tail: list[int]) -> tuple[int, float, int] | None:
        """(successor, share, order) of the longest n-gram ending ``tail`` that the table holds, or None."""
        keys, size = self.keys, len(self.keys)
        for n in range(min(self.max_order, len(tail)), 0, -1):
            key = np.uint64(_key(tail[len(tail) - n :]))
            at = int(keys.searchsorted(key))
            if at < size and keys[at] == key:
                return int(self.successors[at]), float(self.shares[at]), n
        return None

    def save(self, folder: str | Path) -> None:
        """``ngram.safetensors`` and ``manifest.json`` in ``folder``, each written beside and renamed."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f".{TABLE_FILE}.tmp"
        successors = self.successors.astype(np.uint16 if self.successors.max(initial=0) < 2**16 else np.int32)
        save_file({"keys": self.keys.view(np.int64), "successors": successors,
                   "shares": self.shares.astype(np.float16)}, str(partial))
        partial.chmod(0o644)
        partial.replace(folder / TABLE_FILE)
        write_text_atomic(folder / MANIFEST_FILE, json.dumps(self.manifest, indent=1) + "\n")


def build_table(answers: Iterable[list[int]], max_order: int = 4, min_count: int = 2,
                manifest: dict | None = None) -> NGramTable:
    """The table of ``answers`` (token id lists): for n = 1 .. ``max_order``, every n-gram followed by an answer
    token at least ``min_count`` times, with its most frequent successor (ties: the smallest id) and its share."""
    if max_order < 1 or min_count < 1:
        raise SpecdraftError(f"need max_order >= 1 and min_count >= 1, got {max_order}, {min_count}")
    pieces = [np.asarray(ids, dtype=np.int64) for ids in answers if len(ids) > 1]
    if not pieces:
        raise SpecdraftError("no answer of two or more tokens to build an n-gram table from")
    keys, successors, shares = [], [], []
    for n in range(1, max_order + 1):
        windows = [np.lib.stride_tricks.sliding_window_view(ids, n + 1) for ids in pieces if len(ids) > n]
        if not windows:
            continue
        grams = np.concatenate(windows)  # (N, n + 1): an n-gram and its successor
        pair_keys, nexts = _keys(grams[:, :n]), grams[:, n]
        order = np.lexsort((nexts, pair_keys))  # by key, then successor
        pair_keys, nexts = pair_keys[order], nexts[order]
        new_pair = np.ones(len(nexts), dtype=bool)
        new_pair[1:] = (pair_keys[1:] != pair_keys[:-1]) | (nexts[1:] != nexts[:-1])
        starts = np.flatnonzero(new_pair)
        counts = np.diff(np.append(starts, len(nexts)))  # (P,) occurrences of each (key, successor)
        pair_key, pair_next = pair_keys[starts], nexts[starts]
        new_key = np.ones(len(starts), dtype=bool)
        new_key[1:] = pair_key[1:] != pair_key[:-1]
        group = np.cumsum(new_key) - 1  # (P,) the key each pair belongs to
        totals = np.bincount(group, weights=counts).astype(np.int64)  # (K,)
        best = np.lexsort((-counts, group))  # per key, its most counted pair first (stable: smallest id on ties)
        first = best[np.flatnonzero(np.r_[True, group[best][1:] != group[best][:-1]])]  # (K,)
        keep = totals >= min_count
        keys.append(pair_key[first][keep])
        successors.append(pair_next[first][keep].astype(np.int32))
        shares.append((counts[first][keep] / totals[keep]).astype(np.float32))
    all_keys = np.concatenate(keys)
    order = np.argsort(all_keys, kind="stable")
    all_keys = all_keys[order]
    if len(all_keys) > 1 and np.any(all_keys[1:] == all_keys[:-1]):
        raise SpecdraftError("two n-grams share a 64-bit key; build the table with a smaller max_order")
    info = {"format": FORMAT, "version": 1, "max_order": max_order, "min_count": min_count,
            "entries": len(all_keys), **(manifest or {})}
    return NGramTable(all_keys, np.concatenate(successors)[order], np.concatenate(shares)[order], max_order, info)


def load_table(folder: str | Path, tokenizer_fingerprint: str | None = None) -> NGramTable:
    """The table in ``folder``; with ``tokenizer_fingerprint``, refuses one built with another tokenizer."""
    folder = Path(folder).expanduser()
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text())
        tensors = load_file(str(folder / TABLE_FILE))
    except (OSError, ValueError) as err:
        raise SpecdraftError(f"no n-gram table in {folder}: {err}") from None
    if manifest.get("format") != FORMAT:
        raise SpecdraftError(f"{folder / MANIFEST_FILE} is not an n-gram table's manifest")
    built_with = manifest.get("tokenizer_fingerprint")
    if tokenizer_fingerprint is not None and built_with not in (None, tokenizer_fingerprint):
        raise SpecdraftError(f"the n-gram table in {folder} was built with another tokenizer "
                             f"({built_with}, not {tokenizer_fingerprint})")
    keys = tensors["keys"].view(np.uint64)
    if not (len(keys) == len(tensors["successors"]) == len(tensors["shares"])) or np.any(keys[1:] <= keys[:-1]):
        raise SpecdraftError(f"the n-gram table in {folder} is damaged (keys unsorted or lengths differ)")
    return NGramTable(keys, tensors["successors"], tensors["shares"], int(manifest["max_order"]), manifest)


def open_table(name_or_path: str, tokenizer) -> NGramTable:
    """A shipped table by name (``smollm2-135m-instruct-ngram``) or a table folder, checked against ``tokenizer``'s
    fingerprint when one is given."""
    return load_table(resolve_ngram(name_or_path), tokenizer_fingerprint(tokenizer) if tokenizer is not None else None)


class NGramDrafter:
    """A chain from the target's n-gram table, or a prompt-lookup copy where the context repeats itself."""

    name = "ngram"
    vocab_size = None
    max_context = None

    method = "ngram"
    facts = DrafterFacts(replayable=True)

    @classmethod
    def from_options(cls, target, tokenizer, options: dict[str, str]) -> NGramDrafter:
        """``--drafter ngram``: ``table=FOLDER`` (default: the target's shipped table), ``prompt_lookup_min``,
        ``prompt_lookup_max``."""
        options = dict(options)
        name = options.pop("table", "") or default_ngram(getattr(target, "name", ""))
        return build(cls, options, table=open_table(name, tokenizer))

    def __init__(self, table: NGramTable, prompt_lookup_min: int = 2, prompt_lookup_max: int = 3) -> None:
        """Args:
            table: the n-gram table (:func:`load_table`).
            prompt_lookup_min: a context match of at least this many tokens is copied instead (0: never copy).
            prompt_lookup_max: the longest context n-gram matched.
        """
        if prompt_lookup_min < 0 or (prompt_lookup_min and prompt_lookup_min > prompt_lookup_max):
            raise SpecdraftError(f"need 0 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min}, "
                                 f"{prompt_lookup_max}")
        self.table = table
        self.copies = (PromptLookupDrafter(prompt_lookup_max, prompt_lookup_min) if prompt_lookup_min else None)
        self._last: tuple | None = None  # (context, _first's answer about it)

    def draft_kind(self, context: torch.Tensor, sampling: SamplingConfig) -> int:
        """A context match's size, or 10 × (10 + the table's order) + the first token's share in thirds (0-2);
        0 where it drafts nothing."""
        copied, found = self._first(context)
        if copied:
            return copied
        if found is None:
            return 0
        _, share, order = found
        return 10 * (_SOURCE_BASE + order) + min(int(share * 3), 2)

    def _first(self, context: torch.Tensor) -> tuple[int, tuple[int, float, int] | None]:
        """(the context match's size, or 0; else the table's entry for the context's tail, or None). A step asks
        for its kind, then for its draft, about one context object: the second time reads what the first found."""
        if self._last is not None and self._last[0] is context:
            return self._last[1]
        copied = self.copies.match(context, 1)[0] if self.copies is not None else 0
        found = None if copied else self.table.lookup(context[-self.table.max_order :].tolist())
        self._last = (context, (copied, found))
        return copied, found

    @staticmethod
    def kind_order(kind: int) -> int:
        """The matched size a :meth:`draft_kind` stands for: a context match's size or the table n-gram's order."""
        return kind if kind < 10 * _SOURCE_BASE else kind // 10 - _SOURCE_BASE

    def propose(
        self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Draft:
        size, found = self._first(context)
        self._last = None  # read once: the next step's context is a new object
        if size:
            return self.copies.match(context, num_draft_tokens)[1]
        tail = context[-self.table.max_order :].tolist()
        tokens, shares, orders = [], [], []
        for depth in range(num_draft_tokens):
            if depth:
                found = self.table.lookup(tail)
            if found is None:
                break
            token, share, order = found
            tokens.append(token)
            shares.append(share)
            orders.append(_SOURCE_BASE + order)
            tail = [*tail[1:], token] if len(tail) >= self.table.max_order else [*tail, token]
        if not tokens:
            return EMPTY_DRAFT
        return Draft(torch.tensor(tokens, dtype=torch.long), confidence=torch.tensor(shares, dtype=torch.float32),
                     source=torch.tensor(orders, dtype=torch.long))

    def begin(self, target, cache) -> None:
        pass

    def observe(self, result: VerifyResult) -> None:
        pass
