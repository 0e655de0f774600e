"""Token trees: many candidate continuations verified in one target forward (SpecInfer, Miao et al. 2024;
Medusa, Cai et al. 2024; EAGLE-2, Li et al. 2024).

A tree is two aligned tensors: ``tokens`` (N,) and ``parents`` (N,), where ``parents[i]`` is the index of node i's
parent, or -1 when node i follows the *root* (the last token of the context). Parents come before their children
(``parents[i] < i``), so every prefix of the node list is itself a tree. A chain of γ tokens is the tree with
parents ``[-1, 0, 1, ..., γ-2]``.

:func:`verify_layout` compiles a tree (plus the uncached context tail fed before it, and an optional auxiliary
branch such as Lookahead's Jacobi window) into the position offsets and the attention mask of one forward:
the tail is causal; a node sees the whole tail and its own ancestors; an auxiliary token sees the tail and what the
auxiliary mask allows, never a tree node. :func:`retrieve_indices` gives Medusa's root-to-leaf paths.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdraft.errors import SpecdraftError


def chain_parents(length: int) -> torch.Tensor:
    """Parents of a chain of ``length`` nodes: [-1, 0, 1, ..., length-2]. (N,) long."""
    return torch.arange(-1, length - 1, dtype=torch.long)


def check_tree(tokens: torch.Tensor, parents: torch.Tensor, q: torch.Tensor | None = None) -> None:
    """Raise :class:`SpecdraftError` unless (tokens, parents, q) is a well-formed tree."""
    if tokens.dim() != 1 or parents.shape != tokens.shape:
        raise SpecdraftError(f"tree tokens and parents must be equal-length 1-D, got {tuple(tokens.shape)} and "
                             f"{tuple(parents.shape)}")
    index = torch.arange(tokens.shape[0])
    if bool(((parents < -1) | (parents >= index)).any()):
        raise SpecdraftError("tree parents must satisfy -1 <= parents[i] < i (parents before children)")
    if q is not None and (q.dim() != 2 or q.shape[0] != tokens.shape[0]):
        raise SpecdraftError(f"tree q must be (N, V) with N = {tokens.shape[0]}, got {tuple(q.shape)}")


def depth_list(parents: torch.Tensor | list[int]) -> list[int]:
    """Depth of every node as a list; children of the root have depth 1 (parents come before their children)."""
    depth: list[int] = []
    for parent in parents.tolist() if isinstance(parents, torch.Tensor) else parents:
        depth.append(1 if parent < 0 else depth[parent] + 1)
    return depth


def depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node; children of the root have depth 1. (N,) long."""
    return torch.tensor(depth_list(parents), dtype=torch.long)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """mask[i, j] = node j is node i or one of its ancestors. (N, N) bool, the tree attention mask."""
    size = parents.shape[0]
    mask = torch.eye(size, dtype=torch.bool)
    for i, parent in enumerate(parents.tolist()):
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


def children(parents: torch.Tensor) -> list[list[int]]:
    """children[k + 1] = nodes whose parent is k (children[0]: the root's), each in node order."""
    out: list[list[int]] = [[] for _ in range(parents.shape[0] + 1)]
    for i, parent in enumerate(parents.tolist()):
        out[parent + 1].append(i)
    return out


def retrieve_indices(parents: torch.Tensor) -> torch.Tensor:
    """Root-to-leaf paths (Medusa's ``retrieve_indices``): row r lists the nodes of leaf r's path, -1 padded.

    Returns (num_leaves, max_depth) long.
    """
    has_child = torch.zeros(parents.shape[0], dtype=torch.bool)
    has_child[parents[parents >= 0]] = True
    paths = []
    for leaf in (~has_child).nonzero().flatten().tolist():
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = int(parents[node])
        paths.append(path[::-1])
    width = max((len(p) for p in paths), default=0)
    return torch.tensor([p + [-1] * (width - len(p)) for p in paths], dtype=torch.long).reshape(len(paths), width)


def parents_from_paths(paths: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
    """A static tree from Medusa-style choice paths, e.g. ``[(0,), (1,), (0, 0), (0, 1)]``: path (i, j) is the
    j-th candidate at depth 2 under the i-th candidate at depth 1.

    Every prefix of a path must also be listed. Returns (parents (N,) long, the paths in node order: sorted by
    length, then lexicographically, so parents come first).
    """
    ordered = sorted({tuple(int(c) for c in p) for p in paths}, key=lambda p: (len(p), p))
    if any(len(p) == 0 or min(p) < 0 for p in ordered):
        raise SpecdraftError("tree paths must be non-empty tuples of non-negative choice indices")
    where = {p: i for i, p in enumerate(ordered)}
    parents = []
    for p in ordered:
        if len(p) > 1 and p[:-1] not in where:
            raise SpecdraftError(f"tree path {p} is listed without its prefix {p[:-1]}")
        parents.append(where[p[:-1]] if len(p) > 1 else -1)
    return torch.tensor(parents, dtype=torch.long), ordered


def follow_path(tokens: torch.Tensor, parents: torch.Tensor, wanted: Callable[[int, int], int | None]) -> list[int]:
    """Walk down from the root, at each step taking the child whose token is ``wanted(row, depth)`` (row 0 is the
    root, row i + 1 node i; depth = nodes taken so far; None stops). Returns the nodes taken: greedy verification
    follows the target's argmax this way, greedy replay the recorded answer."""
    kids, ids = children(parents), tokens.tolist()
    path: list[int] = []
    row = 0
    while (want := wanted(row, len(path))) is not None:
        match = next((c for c in kids[row] if ids[c] == want), None)
        if match is None:
            break
        path.append(match)
        row = match + 1
    return path


def insert_path(tokens: torch.Tensor, parents: torch.Tensor, path: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Add a root-to-node ``path`` to a tree, trie-style: it follows existing nodes while their tokens match and
    the rest hangs as a new chain under the last match (how a prompt-lookup copy or a sibling alternative joins a
    model's draft; LLMA, Yang et al. 2023; SpecInfer's token-tree merge, Miao et al. 2024).

    tokens, parents: (N,) long, a tree; path: (P,) long. Returns (tokens (N + R,), parents (N + R,)) where R is the
    number of new nodes (0 when the path is already in the tree). Parents still come before children.
    """
    kids: dict[tuple[int, int], int] = {}  # (parent, token) -> node; the first node wins if the tree repeats one
    for node, (parent, token) in enumerate(zip(parents.tolist(), tokens.tolist(), strict=True)):
        kids.setdefault((parent, token), node)
    at, matched = -1, 0
    for token in path.tolist():
        child = kids.get((at, token))
        if child is None:
            break
        at, matched = child, matched + 1
    rest = path[matched:]  # (R,): under node ``at`` (or the root), then a chain
    if not len(rest):
        return tokens, parents
    size = tokens.shape[0]
    new_parents = torch.cat([torch.tensor([at]), torch.arange(size, size + len(rest) - 1)])  # (R,)
    return torch.cat([tokens, rest]), torch.cat([parents, new_parents])


def is_chain(parents: torch.Tensor) -> bool:
    """Whether a tree is the chain ``[-1, 0, 1, ...]`` (one path, nodes in order)."""
    return bool(torch.equal(parents, chain_parents(parents.shape[0])))


def keep_nodes(parents: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Restrict a tree to the nodes where ``keep`` (N,) bool is True; ``keep`` must be closed under parents.

    Returns (kept node indices (M,), their parents renumbered (M,)).
    """
    kept = keep.nonzero().flatten()  # (M,)
    new_index = torch.full((parents.shape[0] + 1,), -1, dtype=torch.long)  # slot 0: the root
    new_index[kept + 1] = torch.arange(kept.shape[0])
    old_parents = parents[kept]  # (M,)
    if bool((old_parents >= 0).logical_and(~keep[old_parents.clamp_min(0)]).any()):
        raise SpecdraftError("cannot drop a tree node while keeping one of its descendants")
    return kept, new_index[old_parents + 1]


@dataclass(frozen=True)
class AuxBranch:
    """Extra tokens fed in the verify forward whose logits go back to the drafter (Lookahead's Jacobi window).

    tokens: (A,) ids. offsets: (A,) positions relative to the root (the last context token), each >= 1.
    mask: (A, A) bool, which auxiliary tokens each one attends (itself included); every auxiliary token also
    sees the whole context and no tree node, and no tree node sees it.
    """

    tokens: torch.Tensor
    offsets: torch.Tensor
    mask: torch.Tensor

    def __post_init__(self) -> None:
        size = self.tokens.shape[0]
        if self.tokens.dim() != 1 or self.offsets.shape != (size,) or self.mask.shape != (size, size):
            raise SpecdraftError("auxiliary branch needs tokens (A,), offsets (A,) and mask (A, A)")
        if size and int(self.offsets.min()) < 1:
            raise SpecdraftError("auxiliary branch offsets must be >= 1 (after the root)")


def verify_layout(
    tail_length: int, parents: torch.Tensor, aux: AuxBranch | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and attention mask of one forward over ``tail + tree + aux`` (T = tail + N + A tokens).

    Args:
        tail_length: uncached context tokens fed first (>= 1; the last one is the root).
        parents: (N,) the tree.
        aux: an optional auxiliary branch.

    Returns:
        offsets (T,) long: each token's position minus the first fed token's position;
        mask (T, T) bool: mask[i, j] = fed token i attends fed token j (every cached position is visible to all).
    """
    size = parents.shape[0]
    extra = 0 if aux is None else aux.tokens.shape[0]
    total = tail_length + size + extra
    root = tail_length - 1
    offsets = torch.empty(total, dtype=torch.long)
    offsets[:tail_length] = torch.arange(tail_length)
    offsets[tail_length : tail_length + size] = root + depths(parents)
    mask = torch.zeros(total, total, dtype=torch.bool)
    mask[:tail_length, :tail_length] = torch.ones(tail_length, tail_length, dtype=torch.bool).tril()
    mask[tail_length:, :tail_length] = True
    nodes = slice(tail_length, tail_length + size)
    mask[nodes, nodes] = ancestor_mask(parents)
    if aux is not None:
        offsets[tail_length + size :] = root + aux.offsets
        mask[tail_length + size :, tail_length + size :] = aux.mask
    return offsets, mask


def expansion_mask(nodes: list[int], parents: list[int], slot_of: dict[int, int], visible: int,
                   start: int) -> torch.Tensor:
    """Mask of one drafter forward that expands the frontier ``nodes`` of a tree being grown in the drafter's cache
    (EAGLE-2-style dynamic trees): each node sees the first ``visible`` slots (the context) and its ancestors' slots.
    The nodes are written at slots ``start ..``, recorded in ``slot_of``.

    Returns (F, start + F) bool, a mask over every slot.
    """
    mask = torch.zeros(len(nodes), start + len(nodes), dtype=torch.bool)  # (F, S)
    mask[:, :visible] = True
    for row, node in enumerate(nodes):
        slot_of[node] = start + row
        ancestor = node
        while ancestor >= 0:
            mask[row, slot_of[ancestor]] = True
            ancestor = parents[ancestor]
    return mask


def most_confident(parents: list[int], scores: list[float], limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-2's re-ranking: the ``limit`` nodes with the highest cumulative draft log-probability, closed under
    ancestors. Returns (kept node indices (M,), their parents renumbered (M,)), as :func:`keep_nodes`."""
    keep = torch.zeros(len(parents), dtype=torch.bool)
    for node in sorted(range(len(parents)), key=lambda n: -scores[n])[:limit]:
        while node >= 0 and not keep[node]:
            keep[node] = True
            node = parents[node]
    return keep_nodes(torch.tensor(parents, dtype=torch.long), keep)


def add_children(node: int, probs: torch.Tensor, count: int, greedy: bool, generator: torch.Generator | None,
                 tree: tuple[list, list, list, list]) -> list[int]:
    """Grow ``count`` children under ``node`` of a dynamic tree (EAGLE-2; SpecInfer): the top-``count`` tokens of
    ``probs`` (V,) when greedy, else ``count`` i.i.d. draws from it. ``tree`` is (tokens, parents, q_rows, scores),
    appended to in place; a child's score is its parent's plus log q(child). Returns the new node indices."""
    tokens, parents, q_rows, scores = tree
    picks = (probs.topk(min(count, probs.shape[0])).indices if greedy else
             torch.multinomial(probs, count, replacement=True, generator=generator))
    new = []
    for token in picks.tolist():
        new.append(len(tokens))
        tokens.append(token)
        parents.append(node)
        q_rows.append(probs)
        scores.append((scores[node] if node >= 0 else 0.0) + float(probs[token].clamp_min(1e-30).log()))
    return new
