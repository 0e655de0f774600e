"""The REST datastore (He et al. 2023, *REST: Retrieval-Based Speculative Decoding*, arXiv 2311.08252): a token
corpus with an exact-match index, a suffix array, built offline and memory-mapped at decoding time.

Layout of a datastore folder:

- ``tokens.npy``: (N,) int32, the documents' token ids, each document followed by :data:`SEPARATOR` (-1), so a
  match never runs from one document into the next and every continuation stops at its document's end;
- ``suffix_array.npy``: (N,) int32, the start positions of all suffixes of ``tokens`` in lexicographic order
  (a suffix that is a prefix of another sorts first; -1 sorts below every token id);
- ``manifest.json``: tokenizer fingerprint (:func:`specdraft.compat.tokenizer_fingerprint`), source, document and
  token counts, build time, and each ``.npy`` file's size and SHA-256.

REST's own index (DraftRetriever) builds its suffix array with libsais and does not separate documents; here the
suffix array is built in numpy by prefix doubling (Manber and Myers 1993), which is exact for any corpus.
Every file is written to a temporary name and renamed; the old manifest is removed first and the new one written
last, so an interrupted build leaves a folder that refuses to load rather than a half index that loads.

This module is the index the REST drafter reads; building one from a text corpus is :func:`specdraft.datastore.build`.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdraft.compat import tokenizer_fingerprint
from specdraft.errors import SpecdraftError
from specdraft.files import cache_dir

SEPARATOR = -1
FORMAT = "specdraft-datastore"
VERSION = 1
FILES = ("tokens.npy", "suffix_array.npy")
MANIFEST = "manifest.json"
DEFAULT_SOURCE = "sharegpt"


def _refine(rank: np.ndarray, active: np.ndarray, first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Sort the ``active`` suffixes (K,) by (first, second) rank keys, split each group of equal ``first`` into runs
    of equal ``second``, and give each suffix its run's start as its new rank (in place). Returns the suffixes
    still tied with another one."""
    order = np.argsort(first * (rank.shape[0] + 1) + second + 1)  # (K,) int64 keys; ties share a rank below
    active, first, second = active[order], first[order], second[order]
    pos = np.arange(active.size)
    new_group = np.concatenate([[True], first[1:] != first[:-1]])
    new_run = new_group | np.concatenate([[True], second[1:] != second[:-1]])
    group_start = np.maximum.accumulate(np.where(new_group, pos, 0))
    run_start = np.maximum.accumulate(np.where(new_run, pos, 0))
    rank[active] = first + run_start - group_start  # rank = how many suffixes sort strictly before
    run_id = np.cumsum(new_run) - 1
    return active[np.bincount(run_id)[run_id] > 1]


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Start positions of the suffixes of ``tokens`` in lexicographic order, by prefix doubling (Manber and Myers
    1993) with vectorised numpy sorts.

    After the round with span h, a suffix's rank is the number of suffixes whose first h tokens sort strictly
    before its own; the next round sorts only the suffixes still tied, by (rank, rank of the suffix h tokens later),
    which orders them by their first 2h tokens. So the work is one argsort of everything, then argsorts of the
    repeated stretches only, about log2(longest repeat) rounds. Ranks depend only on key values, never on how ties
    were ordered, so the result is the same on every run. Past the end ranks -1, below every token (>= -1).

    Args:
        tokens: (N,) integer ids >= -1, N < 2^31.
    Returns:
        (N,) int32.
    """
    n = int(tokens.shape[0])
    if n >= 2**31 - 1:
        raise SpecdraftError(f"datastore too large: {n} tokens (at most 2^31 - 2)")
    if n == 0:
        return np.empty(0, dtype=np.int32)
    rank = np.zeros(n, dtype=np.int64)  # (N,)
    active = _refine(rank, np.arange(n), rank.copy(), np.asarray(tokens, dtype=np.int64))  # by first token
    span = 1
    while active.size:
        later = active + span
        second = np.where(later < n, rank[np.minimum(later, n - 1)], -1)  # (K,)
        active = _refine(rank, active, rank[active], second)
        span *= 2
    order = np.empty(n, dtype=np.int32)
    order[rank] = np.arange(n, dtype=np.int32)
    return order


def join_documents(token_lists: Iterable[Sequence[int]]) -> tuple[np.ndarray, int]:
    """(tokens (N,) int32 with :data:`SEPARATOR` after each non-empty document, number of documents)."""
    parts, count = [], 0
    for ids in token_lists:
        if len(ids):
            parts.append(np.asarray(ids, dtype=np.int32))
            parts.append(np.array([SEPARATOR], dtype=np.int32))
            count += 1
    tokens = np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)
    if tokens.size and int(tokens.min()) < SEPARATOR:
        raise SpecdraftError("datastore token ids must be non-negative")
    return tokens, count


@dataclass(frozen=True)
class Datastore:
    """A token corpus and its suffix array, with REST's exact-match retrieval."""

    tokens: np.ndarray  # (N,) int32, SEPARATOR-terminated documents
    suffix_array: np.ndarray  # (N,) int32
    manifest: dict

    @classmethod
    def from_documents(cls, token_lists: Iterable[Sequence[int]], **manifest) -> Datastore:
        """An in-memory datastore over token-id documents (tests, small corpora)."""
        tokens, count = join_documents(token_lists)
        return cls(tokens, suffix_array(tokens), {"documents": count, "tokens": int(tokens.size), **manifest})

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def find(self, pattern: Sequence[int]) -> tuple[int, int]:
        """[lo, hi): the suffix-array rows whose suffix starts with ``pattern`` (lo == hi when it never occurs).

        Two binary searches; each probe compares the first len(pattern) tokens of one suffix as a Python list,
        whose ordering (element-wise, a shorter prefix first) is the suffix array's.
        """
        pattern = [int(t) for t in pattern]
        m = len(pattern)

        def head(start) -> list[int]:
            return self.tokens[start : start + m].tolist()

        lo = bisect.bisect_left(self.suffix_array, pattern, key=head)
        hi = bisect.bisect_right(self.suffix_array, pattern, lo=lo, key=head)
        return lo, hi

    def longest_suffix_match(self, context: Sequence[int], min_length: int, max_length: int) -> tuple[int, int, int]:
        """(m, lo, hi) for the longest suffix of ``context`` of ``min_length`` to ``max_length`` tokens that occurs
        (REST tries suffix lengths from the longest down); m = 0 when none occurs.

        If a suffix of length m occurs, so does every shorter one, so a binary search over m needs about
        log2(max_length) lookups instead of one per length.
        """
        context = list(context)
        low, high = min_length, min(max_length, len(context))
        best = (0, 0, 0)
        while low <= high:
            m = (low + high) // 2
            lo, hi = self.find(context[len(context) - m :])
            if hi > lo:
                best, low = (m, lo, hi), m + 1
            else:
                high = m - 1
        return best

    def continuations(self, lo: int, hi: int, skip: int, length: int, max_occurrences: int) -> np.ndarray:
        """The ``length`` tokens after each of the occurrences in suffix-array rows [lo, hi), ``skip`` tokens past
        each occurrence's start; -1 after a document ends.

        At most ``max_occurrences`` are read (REST caps them at 5000), evenly spaced over the rows; REST reads
        the first ones, which in suffix-array order favours continuations that sort first.

        Returns:
            (K, length) int32.
        """
        count = hi - lo
        if count > max_occurrences:
            rows = lo + (np.arange(max_occurrences, dtype=np.int64) * count) // max_occurrences  # (K,)
            starts = self.suffix_array[rows].astype(np.int64)
        else:
            starts = np.asarray(self.suffix_array[lo:hi], dtype=np.int64)  # (K,)
        where = starts[:, None] + skip + np.arange(length)  # (K, length)
        out = self.tokens[np.minimum(where, len(self) - 1)]  # the last token is a separator
        alive = np.cumprod(out != SEPARATOR, axis=1).astype(bool)  # (K, length) before the document's end
        return np.where(alive, out, SEPARATOR).astype(np.int32)


# --- on disk --------------------------------------------------------------------------------------------------------


def default_dir(source: str, fingerprint: str) -> Path:
    """``<specdraft cache>/datastores/<source name>-<tokenizer fingerprint>``."""
    name = source if source == DEFAULT_SOURCE else re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(source).stem) or "corpus"
    return cache_dir() / "datastores" / f"{name}-{fingerprint}"


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def save(store: Datastore, out: str | Path) -> dict:
    """Write ``store`` to the folder ``out`` (created if needed); returns the manifest written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # until the new manifest lands, the folder does not load
    files = {}
    for name, array in zip(FILES, (store.tokens, store.suffix_array), strict=True):
        _write_atomic(out / name, lambda f, a=array: np.save(f, np.ascontiguousarray(a, dtype=np.int32)))
        files[name] = {"bytes": (out / name).stat().st_size, "sha256": _sha256(out / name)}
    manifest = {"format": FORMAT, "version": VERSION, **store.manifest, "separator": SEPARATOR, "files": files}
    _write_atomic(out / MANIFEST, lambda f: f.write((json.dumps(manifest, indent=2) + "\n").encode()))
    return manifest


def _read_manifest(path: Path) -> dict:
    if not (path / MANIFEST).is_file():
        raise SpecdraftError(f"no datastore at {path} (no {MANIFEST}; an interrupted build leaves none): run "
                             "`specdraft build-datastore`")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise SpecdraftError(f"corrupt datastore manifest {path / MANIFEST}: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise SpecdraftError(f"{path / MANIFEST} is not a version-{VERSION} specdraft datastore manifest")
    if not isinstance(manifest.get("files"), dict) or set(manifest["files"]) != set(FILES):
        raise SpecdraftError(f"{path / MANIFEST} does not list the index files {', '.join(FILES)}")
    return manifest


def _open_array(path: Path, expected: dict, verify: bool) -> np.ndarray:
    if not path.is_file() or path.stat().st_size != expected.get("bytes"):
        raise SpecdraftError(f"corrupt datastore: {path} is missing or has the wrong size (truncated?); rebuild it "
                             "with `specdraft build-datastore`")
    if verify and _sha256(path) != expected.get("sha256"):
        raise SpecdraftError(f"corrupt datastore: {path} does not match its SHA-256 in {MANIFEST}; rebuild it")
    try:
        array = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as exc:
        raise SpecdraftError(f"corrupt datastore file {path}: {exc}") from None
    if array.dtype != np.int32 or array.ndim != 1:
        raise SpecdraftError(f"corrupt datastore file {path}: expected a 1-D int32 array, got {array.dtype} "
                             f"{array.shape}")
    return array


def load(path: str | Path, tokenizer=None, verify: bool = True) -> Datastore:
    """Memory-map the datastore in the folder ``path``.

    Args:
        tokenizer: when given, its fingerprint must equal the one the datastore was built with.
        verify: check each file's SHA-256 (reads the files once; sizes are always checked).
    """
    path = Path(path).expanduser()
    manifest = _read_manifest(path)
    if tokenizer is not None and manifest.get("tokenizer_fingerprint") != tokenizer_fingerprint(tokenizer):
        raise SpecdraftError(
            f"datastore {path} was built with another tokenizer (fingerprint {manifest.get('tokenizer_fingerprint')}, "
            f"the target's is {tokenizer_fingerprint(tokenizer)}): rebuild it with `specdraft build-datastore`"
        )
    tokens, sa = (_open_array(path / name, manifest["files"][name], verify) for name in FILES)
    if tokens.shape != sa.shape or tokens.shape[0] != manifest.get("tokens"):
        raise SpecdraftError(f"corrupt datastore {path}: token and suffix array lengths disagree with {MANIFEST}")
    if tokens.shape[0] and int(tokens[-1]) != SEPARATOR:
        raise SpecdraftError(f"corrupt datastore {path}: tokens.npy does not end with the separator")
    return Datastore(tokens, sa, manifest)
