"""REST: Retrieval-Based Speculative Decoding (He et al. 2023, arXiv 2311.08252). Training-free and deterministic.

At each step: find the longest suffix of the context (``max_suffix`` down to ``min_suffix`` tokens) that occurs in a
datastore (:mod:`specdraft.datastore_index`, an exact-match suffix-array index), read the next ``num_draft_tokens``
tokens after its occurrences (at most ``max_occurrences``, 5000 in REST's DraftRetriever), put them in a trie whose
nodes count how many retrieved continuations pass through them (the prefix frequency), and keep the most frequent nodes,
as REST does, as a token tree. The candidates are point masses (q = None), so tree verification keeps the output exactly
the target's, greedy or sampled.
"""

from __future__ import annotations

import heapq
from pathlib import Path

import numpy as np
import torch

from specdraft.compat import tokenizer_fingerprint
from specdraft.datastore_index import DEFAULT_SOURCE, Datastore, default_dir, load
from specdraft.drafters.base import EMPTY_DRAFT, Draft, DrafterFacts
from specdraft.drafters.options import build
from specdraft.errors import SpecdraftError
from specdraft.sampling import SamplingConfig
from specdraft.verification import VerifyResult


def _trie_nodes(rows: np.ndarray) -> tuple[np.ndarray, ...]:
    """All trie nodes of the continuations ``rows`` (K, D), numbered depth by depth.

    Sorting the rows lexicographically makes every trie node a run of consecutive rows: at depth d a new node
    starts where the prefix rows[:, :d+1] changes. Returns (token, count, depth, parent, first_row), each (G,),
    with parents non-decreasing (the children of a node are consecutive).
    """
    rows = rows[np.lexsort(rows.T[::-1])]  # (K, D), -1 (ended) sorts first
    num_rows, width = rows.shape
    new = np.zeros(num_rows, dtype=bool)
    node_of_row = np.full(num_rows, -1, dtype=np.int64)  # (K,) node at the previous depth, -1 = root
    parts, next_id = [], 0
    for d in range(width):
        new |= np.concatenate([[True], rows[1:, d] != rows[:-1, d]])  # the prefix up to depth d changes
        starts = np.flatnonzero(new)  # (S,) first row of each run
        lengths = np.diff(np.append(starts, num_rows))  # (S,)
        token = rows[starts, d]
        alive = token >= 0
        ids = np.where(alive, next_id + np.cumsum(alive) - 1, -2)  # (S,) node ids, -2 for ended runs
        parts.append((token[alive], lengths[alive], np.full(int(alive.sum()), d + 1), node_of_row[starts[alive]],
                      starts[alive]))
        node_of_row = np.repeat(ids, lengths)
        next_id += int(alive.sum())
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(5))


def continuation_trie(rows: np.ndarray, max_nodes: int, max_candidates: int) -> tuple[list[int], list[int]]:
    """REST's draft tree: the most frequent prefixes of the retrieved continuations.

    REST counts, for every prefix of every continuation, how many continuations start with it, and keeps the
    ``choices`` prefixes with the highest counts. A child never counts more than its parent, so taking nodes
    best-first from the root (highest count; ties: shallower, then smaller token ids) gives that top set as a tree.
    Here at most ``max_nodes`` nodes are kept, with at most ``max_candidates`` leaves (root-to-leaf candidates).

    Args:
        rows: (K, D) continuation token ids, -1 after a continuation ends.
    Returns:
        (tokens, parents): node tokens and parents (-1 = child of the root) in selection order, parents first.
    """
    if rows.size == 0 or max_nodes < 1:
        return [], []
    token, count, depth, parent, first_row = _trie_nodes(rows)
    child_lo = np.searchsorted(parent, np.arange(-1, token.shape[0]), side="left")  # children of node g at g + 1
    child_hi = np.searchsorted(parent, np.arange(-1, token.shape[0]), side="right")
    heap: list[tuple[int, int, int, int]] = []

    def push_children(node: int) -> None:
        lo, hi = int(child_lo[node + 1]), int(child_hi[node + 1])
        # Only a node's max_candidates most frequent children can be kept: every later one adds a leaf.
        for child in (lo + np.argsort(-count[lo:hi], kind="stable")[:max_candidates]).tolist():
            heapq.heappush(heap, (-int(count[child]), int(depth[child]), int(first_row[child]), child))

    out_of: dict[int, int] = {-1: -1}  # trie node -> output index
    has_child: set[int] = set()
    tokens: list[int] = []
    parents: list[int] = []
    leaves = 0
    push_children(-1)
    while heap and len(tokens) < max_nodes:
        node = heapq.heappop(heap)[3]
        up = int(parent[node])
        adds_leaf = up < 0 or up in has_child
        if adds_leaf and leaves == max_candidates:
            continue
        leaves += adds_leaf
        has_child.add(up)
        out_of[node] = len(tokens)
        tokens.append(int(token[node]))
        parents.append(out_of[up])
        push_children(node)
    return tokens, parents


class RESTDrafter:
    """Retrieval-based drafts from a datastore (``specdraft build-datastore``), as a token tree."""

    name = "rest"
    vocab_size = None
    max_context = None

    method = "rest"
    facts = DrafterFacts(replayable=True)

    @classmethod
    def from_options(cls, target, tokenizer, options: dict[str, str]) -> RESTDrafter:
        """``--drafter rest``: the datastore of the target's tokenizer (options: the constructor's)."""
        return build(cls, options, tokenizer=tokenizer, store=None)

    def __init__(self, datastore: str = "", max_suffix: int = 16, min_suffix: int = 2, max_candidates: int = 8,
                 max_nodes: int = 32, max_occurrences: int = 5000, verify: bool = True,
                 tokenizer=None, store: Datastore | None = None) -> None:
        """Args:
            datastore: a datastore folder; "" = the default ShareGPT datastore for ``tokenizer``.
            max_suffix, min_suffix: longest and shortest context suffix matched (REST: 16 and 2).
            max_candidates: at most this many root-to-leaf candidates (continuations) in the tree.
            max_nodes: at most this many tree nodes (REST's ``choices``).
            max_occurrences: at most this many occurrences read per step (REST: 5000).
            verify: check the index files' SHA-256 when loading (sizes are always checked).
            tokenizer: the target's tokenizer: finds the default datastore and must match the datastore's.
            store: an already loaded datastore (then ``datastore`` is ignored).
        """
        if not 1 <= min_suffix <= max_suffix:
            raise SpecdraftError(f"need 1 <= min_suffix <= max_suffix, got {min_suffix}, {max_suffix}")
        for key, value in (("max_candidates", max_candidates), ("max_nodes", max_nodes),
                           ("max_occurrences", max_occurrences)):
            if value < 1:
                raise SpecdraftError(f"{key} must be at least 1, got {value}")
        self.max_suffix, self.min_suffix = max_suffix, min_suffix
        self.max_candidates, self.max_nodes, self.max_occurrences = max_candidates, max_nodes, max_occurrences
        self.store = store if store is not None else _open(datastore, tokenizer, verify)
        self.vocab_limit: int | None = None

    def begin(self, target, cache) -> None:
        self.vocab_limit = target.vocab_size  # token ids the target cannot score end a continuation

    def propose(
        self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Draft:
        tail = context[-self.max_suffix :].tolist()
        length, lo, hi = self.store.longest_suffix_match(tail, self.min_suffix, self.max_suffix)
        while length >= self.min_suffix:  # a match that only ends documents gives nothing: try a shorter one
            rows = self.store.continuations(lo, hi, length, num_draft_tokens, self.max_occurrences)  # (K, γ)
            if self.vocab_limit is not None:
                rows = np.where(np.cumprod(rows < self.vocab_limit, axis=1).astype(bool), rows, -1)
            tokens, parents = continuation_trie(rows, self.max_nodes, self.max_candidates)
            if tokens:
                return Draft(torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long))
            length -= 1
            lo, hi = self.store.find(tail[len(tail) - length :])
        return EMPTY_DRAFT

    def observe(self, result: VerifyResult) -> None:
        pass


def _open(datastore: str, tokenizer, verify: bool) -> Datastore:
    if datastore:
        return load(Path(datastore).expanduser(), tokenizer, verify)
    if tokenizer is None:
        raise SpecdraftError("the rest drafter needs a datastore folder or the target's tokenizer")

    where = default_dir(DEFAULT_SOURCE, tokenizer_fingerprint(tokenizer))
    if not (where / "manifest.json").is_file():
        raise SpecdraftError(f"no default datastore for this tokenizer at {where}: build it once with `specdraft "
                             "build-datastore --target <target>` (or pass datastore=FOLDER)")
    return load(where, tokenizer, verify)
