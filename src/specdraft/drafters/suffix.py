"""SuffixDecoding (Oliaro et al. 2024, *SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications*,
arXiv 2411.04975; vLLM's ``method: "suffix"``, built on Snowflake's ArcticInference): model-free drafts from suffix
trees over earlier outputs and the current context. Training-free and deterministic (q = None, point masses).

Two suffix trees (tries of bounded depth D, each node counting the occurrences of the token sequence that spells its
path):

- a **global tree** over the outputs this drafter has generated before (the tokens after each prompt; the most
  recent ``max_cached_outputs``, oldest evicted first), so answers that repeat are drafted from earlier answers;
- a **per-request tree** over the current context (prompt and tokens generated so far), extended as tokens are
  committed.

Each step, for every pattern length p = 1, 2, ... (the last p context tokens, while they occur in a tree) the match
node's subtree gives candidate continuations, each node N with the empirical probability

    D(N) = prod over the path from the match to N of count(child) / count(parent)

(the paper's D(N), from frequencies). A draft grows from the match by the paper's greedy expansion: a chain follows
the most frequent child, a tree (``tree_nodes`` > 0) takes the most probable node of the subtree's frontier, best
first; a node with D(N) < ``min_token_prob`` is never added, and a draft holds at most

    MAX_SPEC = max_spec_factor * p + max_spec_offset

tokens (the paper's alpha * p: a longer match earns a longer draft), never deeper than the step's budget. The draft
with the highest SCORE = sum of D(N) over its nodes wins, across pattern lengths and both trees (ties: the longer
match, then the per-request tree). Each node's ``confidence`` is its conditional frequency count(child) /
count(parent); ``source`` says which tree it came from, so adaptive speculation learns each apart.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdraft.drafters.base import EMPTY_DRAFT, Draft, DrafterFacts
from specdraft.errors import SpecdraftError
from specdraft.sampling import SamplingConfig
from specdraft.verification import VerifyResult

LOCAL, GLOBAL = 0, 1  # Draft.source: the per-request tree, the global tree of earlier outputs


class _Node:
    __slots__ = ("children", "count", "last")

    def __init__(self) -> None:
        self.count = 0
        self.last = 0  # when an occurrence last passed through (ties between equally frequent children)
        self.children: dict[int, _Node] = {}


class SuffixTree:
    """A suffix trie of depth at most ``max_depth`` over token sequences: every substring of at most ``max_depth``
    tokens of an added sequence is a root path, and each node counts the positions where its path occurs."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()
        self.clock = 0  # tokens added so far

    def extend(self, tokens: Sequence[int], active: list[_Node] | None = None, delta: int = 1) -> list[_Node]:
        """Append ``tokens`` to a sequence whose unfinished suffixes end at ``active`` (None or [] for a new
        sequence); ``delta`` = -1 removes them instead (a count reaching 0 drops its node). Returns the new
        ``active``: the nodes of the suffixes still shorter than ``max_depth``."""
        active = list(active or [])  # deepest first: depths len(active), ..., 1
        for token in tokens:
            self.clock += 1
            following = []
            for node in [*active, self.root]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += delta
                if delta > 0:
                    child.last = self.clock
                if child.count <= 0:
                    del node.children[token]
                following.append(child)
            active = following[max(0, len(following) - self.max_depth + 1) :] if self.max_depth > 1 else []
        return active

    def match(self, pattern: Sequence[int]) -> _Node | None:
        """The node whose path is ``pattern``, or None when it does not occur."""
        node = self.root
        for token in pattern:
            node = node.children.get(token)
            if node is None:
                return None
        return node


@dataclass
class Candidate:
    """A draft from one match: tokens, parents (-1 = after the context), each node's conditional frequency and path
    probability D(N); ``score`` = sum of D(N)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    conditional: list[float] = field(default_factory=list)
    score: float = 0.0
    match_length: int = 0


def _by_count(node: _Node) -> list[tuple[int, _Node]]:
    """Children, most frequent first (ties: the most recently seen, as prompt lookup prefers the latest match)."""
    return sorted(node.children.items(), key=lambda item: (-item[1].count, -item[1].last))


def speculate_path(node: _Node, limit: int, min_token_prob: float) -> Candidate:
    """The chain that follows the most frequent child from ``node``, at most ``limit`` tokens, stopping before a
    token whose path probability would fall below ``min_token_prob``."""
    out, prob = Candidate(), 1.0
    while len(out.tokens) < limit and node.children:
        token, child = _by_count(node)[0]
        conditional = child.count / node.count
        if prob * conditional < min_token_prob:
            break
        prob *= conditional
        out.parents.append(len(out.tokens) - 1)
        out.tokens.append(token)
        out.conditional.append(conditional)
        out.score += prob
        node = child
    return out


def speculate_tree(node: _Node, limit: int, max_depth: int, min_token_prob: float) -> Candidate:
    """The ``limit`` most probable nodes of ``node``'s subtree, at most ``max_depth`` deep, each with a path
    probability of at least ``min_token_prob``: best-first from the match (a child is never more probable than its
    parent, so the result is closed under parents, parents first)."""
    out = Candidate()
    heap: list[tuple[float, int, int, int, int, float, _Node]] = []  # (-D, depth, order, token, parent, cond, node)
    order = 0

    def push(parent_node: _Node, parent: int, prob: float, depth: int) -> None:
        nonlocal order
        for token, child in _by_count(parent_node):
            conditional = child.count / parent_node.count
            if prob * conditional >= min_token_prob:
                heapq.heappush(heap, (-prob * conditional, depth, order, token, parent, conditional, child))
                order += 1

    push(node, -1, 1.0, 1)
    while heap and len(out.tokens) < limit:
        negative, depth, _, token, parent, conditional, child = heapq.heappop(heap)
        out.parents.append(parent)
        out.tokens.append(token)
        out.conditional.append(conditional)
        out.score -= negative
        if depth < max_depth:
            push(child, len(out.tokens) - 1, -negative, depth + 1)
    return out


class SuffixDrafter:
    """SuffixDecoding (module docstring): a global suffix tree over earlier outputs and a per-request one over the
    context; drafts a chain (``tree_nodes`` = 0) or a token tree of at most ``tree_nodes`` nodes."""

    name = "suffix"
    vocab_size = None
    max_context = None

    method = "suffix"
    facts = DrafterFacts()  # it also drafts from earlier answers, so a proposal is not the context's alone

    def __init__(self, max_depth: int = 24, max_spec_factor: float = 4.0, max_spec_offset: float = 0.0,
                 min_token_prob: float = 0.1, tree_nodes: int = 8, max_cached_outputs: int = 1024) -> None:
        """Args:
            max_depth: depth of both suffix trees: the longest pattern matched and continuation stored (vLLM: 24).
            max_spec_factor, max_spec_offset: a match of p tokens drafts at most factor * p + offset tokens (vLLM's
                defaults are 1 and 0; on Spec-Bench with SmolLM2 at γ 4, 4 drafted more of what was accepted).
            min_token_prob: no drafted node has a path probability D(N) below this (vLLM: 0.1).
            tree_nodes: 0 drafts a chain (vLLM's path mode); N > 0 a token tree of at most N nodes (the paper's
                speculation tree).
            max_cached_outputs: outputs kept in the global tree (oldest evicted first); 0 = no global tree.
        """
        checks = (("max_depth", max_depth >= 1), ("max_spec_factor", max_spec_factor >= 0),
                  ("min_token_prob", 0 <= min_token_prob <= 1), ("tree_nodes", tree_nodes >= 0),
                  ("max_cached_outputs", max_cached_outputs >= 0))
        for option, ok in checks:
            if not ok:
                raise SpecdraftError(f"suffix option {option} is out of range (max_depth >= 1, max_spec_factor >= 0, "
                                     "0 <= min_token_prob <= 1, tree_nodes >= 0, max_cached_outputs >= 0)")
        self.max_depth, self.max_spec_factor, self.max_spec_offset = max_depth, max_spec_factor, max_spec_offset
        self.min_token_prob, self.tree_nodes, self.max_cached_outputs = min_token_prob, tree_nodes, max_cached_outputs
        self.global_tree = SuffixTree(max_depth)
        self.outputs: deque[list[int]] = deque()  # what the global tree holds, oldest first
        self._local = SuffixTree(max_depth)
        self._seen: list[int] = []  # context tokens in the per-request tree (all but the last one)
        self._active: list = []
        self._prompt_length: int | None = None

    def begin(self, target, cache) -> None:
        """A generation starts: the previous one's output joins the global tree; a new per-request tree."""
        if self._prompt_length is not None:
            self.add_output(self._seen[self._prompt_length :])
        self._local, self._seen, self._active, self._prompt_length = SuffixTree(self.max_depth), [], [], None

    def add_output(self, token_ids: Sequence[int]) -> None:
        """Add an output to the global tree, evicting the oldest beyond ``max_cached_outputs``."""
        if not self.max_cached_outputs or not token_ids:
            return
        self.outputs.append(list(token_ids))
        self.global_tree.extend(self.outputs[-1])
        while len(self.outputs) > self.max_cached_outputs:
            self.global_tree.extend(self.outputs.popleft(), delta=-1)

    def _follow(self, context: torch.Tensor) -> list[int]:
        """Bring the per-request tree to ``context[:-1]`` (the last token's own occurrence would only add a dead
        end to every match's count); returns the context as a list."""
        ids = context.tolist()
        if self._prompt_length is None:
            self._prompt_length = len(ids)
        if len(ids) - 1 < len(self._seen) or ids[: len(self._seen)] != self._seen:  # not a continuation: rebuild
            self._local, self._seen, self._active = SuffixTree(self.max_depth), [], []
        self._active = self._local.extend(ids[len(self._seen) : len(ids) - 1], self._active)
        self._seen = ids[: len(ids) - 1]
        return ids

    def best(self, ids: Sequence[int], budget: int) -> tuple[Candidate, int]:
        """The highest-scoring draft of at most ``budget`` depth after ``ids`` and the tree it came from."""
        best, source = Candidate(), LOCAL
        for kind, tree in ((LOCAL, self._local), (GLOBAL, self.global_tree)):
            for length in range(1, min(len(ids), self.max_depth) + 1):
                node = tree.match(ids[len(ids) - length :])
                if node is None:
                    break
                limit = int(length * self.max_spec_factor + self.max_spec_offset + 1e-6)
                if self.tree_nodes:
                    found = speculate_tree(node, min(limit, self.tree_nodes), budget, self.min_token_prob)
                else:
                    found = speculate_path(node, min(limit, budget), self.min_token_prob)
                found.match_length = length
                if found.tokens and (found.score > best.score or (found.score == best.score and kind == source)):
                    best, source = found, kind
        return best, source

    def propose(
        self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Draft:
        ids = self._follow(context)
        found, source = self.best(ids, num_draft_tokens)
        if not found.tokens:
            return EMPTY_DRAFT
        tokens = torch.tensor(found.tokens, dtype=torch.long)  # (N,)
        parents = torch.tensor(found.parents, dtype=torch.long) if self.tree_nodes else None
        return Draft(tokens, None, parents, None, torch.tensor(found.conditional, dtype=torch.float32),
                     torch.full_like(tokens, source))

    def draft_kind(self, context: torch.Tensor, sampling: SamplingConfig) -> int:
        """The longest pattern (up to 4 tokens) that occurs in either tree: a longer match earns a longer draft."""
        ids = self._follow(context)
        longest = 0
        for tree in (self._local, self.global_tree):
            while longest < min(4, len(ids)) and tree.match(ids[len(ids) - longest - 1 :]) is not None:
                longest += 1
        return longest

    def observe(self, result: VerifyResult) -> None:
        pass
