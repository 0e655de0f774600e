"""Graph-structured speculative decoding (GSD; Gong et al. 2024, *Graph-Structured Speculative Decoding*, ACL
Findings, arXiv 2407.16207): a draft model's token tree whose hypotheses are kept as a directed acyclic graph, so
that a continuation shared by several branches is drafted once.

The draft model grows a dynamic tree as in its tree mode (:class:`~specdraft.drafters.draft_model.DraftModelDrafter`,
EAGLE-2 / SpecInfer style): level by level, nodes get ``tree_branching`` children (their top-k tokens when greedy,
i.i.d. draws from the warped q when sampling), and the ``tree_branching`` most probable new nodes (cumulative draft
log-probability) are expanded in one draft forward. GSD's addition: a new node whose last ``merge_ngram`` tokens (its
own and its ancestors', then the context's) equal those of a node the draft model expanded, or of a more probable
new node of its level, is **merged** into it: an edge of the graph points from its parent to that node's
continuations. It is not fed to the draft model and takes no frontier place (those go to nodes with new recent
tokens), and it draws its children from the q row computed for the node it merged into (the paper merges recurring
token sequences of different hypotheses, whose draft predictions depend mostly on the recent tokens; the draft
model's forward for a repeated suffix is reused). Such children (copies) cannot be expanded themselves, as their path
is not in the draft cache, but merge in turn when their recent tokens match an expanded node, so a merged node
carries the subtree of the node it matched as that subtree grows.

The verifier needs a tree: the graph, with each merged node's continuations copied under it, is one (the paper
unfolds its graph the same way). Greedy, a copy's children are its representative's top-k, i.e. the representative's
own children, and the ``tree_nodes`` most probable nodes are verified (EAGLE-2's re-ranking, as the tree mode).
Sampling, every node's children are fresh i.i.d. draws from the q row they are reported with (a copy never reuses its
representative's draws, only its distribution), and the node budget is spent while growing, level by level in order
of the parents' probability, a group cut to a prefix in draw order when it does not fit: which children a node has
never depends on their own draws, so SpecInfer's multi-draft verification keeps the output distribution exactly the
target's (pruning drawn children by their own probability afterwards would not).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdraft.drafters.base import Draft
from specdraft.drafters.draft_model import DraftModelDrafter
from specdraft.drafters.loading import on_draft_model
from specdraft.errors import SpecdraftError
from specdraft.models.base import CausalLM
from specdraft.sampling import SamplingConfig, warp
from specdraft.trees import add_children, most_confident

COPIED = 2  # Draft.source of a node drawn from a merged node's borrowed q row (the draft model's own nodes: 0)


@dataclass
class TokenGraph:
    """Drafted hypotheses as a graph: nodes (token, parent, q row, cumulative log q) as in a dynamic tree; ``real[n]``:
    node n's path is in the draft cache (its parent is the root or an expanded node), so it can be expanded;
    ``probs[n]``: the q row of an expanded node n; ``rep[n]``: the expanded node whose q row merged node n draws its
    children from; ``keys[n]``: the last ``ngram`` tokens up to node n (the context's before the first node)."""

    context_tail: tuple[int, ...]
    ngram: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    q_rows: list[torch.Tensor] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    keys: list[tuple[int, ...]] = field(default_factory=list)
    real: list[bool] = field(default_factory=list)
    probs: dict[int, torch.Tensor] = field(default_factory=dict)
    rep: dict[int, int] = field(default_factory=dict)
    expanded: dict[tuple[int, ...], int] = field(default_factory=dict)  # key -> the expanded node with that key

    def grow(self, node: int, probs: torch.Tensor, count: int, greedy: bool,
             generator: torch.Generator | None) -> list[int]:
        """``count`` children of ``node`` (-1: the root) drawn from ``probs`` (V,)
        (:func:`specdraft.trees.add_children`)."""
        new = add_children(node, probs, count, greedy, generator, (self.tokens, self.parents, self.q_rows, self.scores))
        before = self.keys[node] if node >= 0 else self.context_tail
        real = node < 0 or (node in self.probs and node not in self.rep)
        for child in new:
            self.keys.append((before + (self.tokens[child],))[-self.ngram :] if self.ngram else ())
            self.real.append(real)
        return new

    def ancestor(self, node: int, of: int) -> bool:
        """Whether ``node`` is ``of``'s ancestor."""
        while of >= 0:
            of = self.parents[of]
            if of == node:
                return True
        return False

    def merge(self, level: list[int]) -> tuple[list[int], dict[int, int]]:
        """Merge the new nodes ``level`` (one depth) into an expanded node with their key (not an ancestor), or a
        real node of ``level`` with their key and a higher probability. Returns the unmerged real nodes, most
        probable first (ties: node order), and the nodes merged into one of them (node -> it), which draw from it
        once it is expanded."""
        fresh, first, pending = [], {}, {}
        ranked = sorted(level, key=lambda n: (not self.real[n], -self.scores[n], n))  # real nodes first
        for node in ranked:
            key = self.keys[node]
            into = self.expanded.get(key) if self.ngram else None
            if into is not None and not self.ancestor(into, node):
                self.rep[node] = into
            elif self.ngram and key in first:
                pending[node] = first[key]
            elif self.real[node]:
                first[key] = node
                fresh.append(node)
        return fresh, pending

    def expand(self, nodes: list[int], probs: torch.Tensor, pending: dict[int, int]) -> None:
        """Record the q rows ``probs`` (F, V) of the expanded ``nodes``; nodes merged into one of them draw from it."""
        for node, row in zip(nodes, probs, strict=True):
            self.probs[node] = row
            self.expanded.setdefault(self.keys[node], node)
        self.rep.update({node: into for node, into in pending.items() if into in self.probs})

    def parents_of_next(self, level: list[int]) -> list[tuple[int, torch.Tensor]]:
        """The nodes of ``level`` that get children, with the q row they draw from, most probable first."""
        out = [(n, self.probs[self.rep.get(n, n)]) for n in level if n in self.rep or n in self.probs]
        return sorted(out, key=lambda item: (-self.scores[item[0]], item[0]))

    def source(self) -> torch.Tensor:
        """(N,): :data:`COPIED` for nodes drawn from a borrowed q row (a merged node's or a copy's children)."""
        return torch.tensor([0 if self.real[n] else COPIED for n in range(len(self.tokens))], dtype=torch.long)


class GraphDrafter(DraftModelDrafter):
    """A draft model's dynamic token tree grown as a graph whose nodes with equal recent tokens are merged (GSD;
    module docstring). ``merge_ngram`` = n: nodes merge when their last n tokens are equal (0: never). Counters over
    all proposals: ``merged_nodes`` (nodes merged), ``drafted_nodes`` (nodes drawn), ``expanded_nodes`` (nodes fed
    to the draft model)."""

    method = "gsd"

    @classmethod
    def from_options(cls, target, tokenizer, options: dict[str, str]) -> GraphDrafter:
        """``--drafter gsd``: on the draft model ``draft=NAME`` (default: the target's shipped drafter)."""
        return on_draft_model(cls, "gsd", target, tokenizer, options)

    def __init__(self, model: CausalLM, name: str | None = None, tree_branching: int = 2, tree_nodes: int = 16,
                 merge_ngram: int = 2, *, keep: torch.Tensor | None = None) -> None:
        if tree_branching < 1 or merge_ngram < 0:
            raise SpecdraftError(f"graph drafts need tree_branching >= 1 and merge_ngram >= 0, got {tree_branching}, "
                                 f"{merge_ngram}")
        super().__init__(model, name, tree_branching, tree_nodes, keep=keep)
        self.merge_ngram = merge_ngram
        self.merged_nodes = self.drafted_nodes = self.expanded_nodes = 0

    def _propose_tree(
        self, context: torch.Tensor, depth: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Draft:
        """A graph of ``depth`` levels as a tree (module docstring)."""
        first = self._sync(context, depth * self.tree_branching)  # (V,) logits after the context
        base = self._cache.length  # the draft cache holds the whole context; expanded nodes are fed after it
        tail = tuple(context[context.shape[0] - self.merge_ngram :].tolist()) if self.merge_ngram else ()
        graph, slot_of = TokenGraph(tail, self.merge_ngram), {}
        growing = [(-1, self._q(first, sampling))]
        for level in range(depth):
            new = self._draw(graph, growing, sampling, generator)
            fresh, pending = graph.merge(new)
            chosen = fresh[: self.tree_branching]
            if level + 1 == depth or not chosen or (not sampling.greedy and len(graph.tokens) >= self.tree_nodes):
                break
            logits = self._expand(chosen, graph.tokens, graph.parents, slot_of, base, level + 1)  # (F, V)
            graph.expand(chosen, torch.stack([self._q(row, sampling) for row in logits]), pending)
            growing = graph.parents_of_next(new)
        self._cache.crop(base)
        self._cached = context
        self.merged_nodes += len(graph.rep)
        self.drafted_nodes += len(graph.tokens)
        self.expanded_nodes += len(graph.probs)
        return self._as_draft(graph, sampling.greedy)

    @staticmethod
    def _q(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
        """The draft distribution (V,) a node's children are drawn from: softmax when greedy (top-k and confidence),
        else warped like p."""
        return torch.softmax(logits.float(), -1) if sampling.greedy else warp(logits, sampling)

    def _draw(self, graph: TokenGraph, growing: list[tuple[int, torch.Tensor]], sampling: SamplingConfig,
              generator: torch.Generator | None) -> list[int]:
        """Children for each of ``growing`` (node, q row) in order: ``tree_branching`` each, at most ``tree_nodes``
        in the level when greedy (pruned later), at most ``tree_nodes`` in the graph when sampling (the last group
        cut to a prefix of its draws)."""
        new: list[int] = []
        for node, probs in growing:
            room = self.tree_nodes - (len(new) if sampling.greedy else len(graph.tokens))
            if room <= 0:
                break
            new += graph.grow(node, probs, min(self.tree_branching, room), sampling.greedy, generator)
        return new

    def _as_draft(self, graph: TokenGraph, greedy: bool) -> Draft:
        """The graph's tree: greedy, its ``tree_nodes`` most probable nodes (closed under ancestors); sampling, all
        of it (the budget was spent while growing)."""
        scores = torch.tensor(graph.scores, dtype=torch.float32)  # (N,) cumulative draft log-probabilities
        parent = torch.tensor(graph.parents, dtype=torch.long)  # (N,)
        confidence = (scores - torch.where(parent >= 0, scores[parent.clamp_min(0)], 0.0)).exp()  # q(node | parent)
        tokens, source = torch.tensor(graph.tokens, dtype=torch.long), graph.source()
        if not greedy:
            return Draft(tokens, torch.stack(graph.q_rows), parent, None, confidence, source)
        kept, parents = most_confident(graph.parents, graph.scores, self.tree_nodes)
        return Draft(tokens[kept], None, parents, None, confidence[kept], source[kept])
