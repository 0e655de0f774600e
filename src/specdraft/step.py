"""One speculative step, the same for batch-1 decoding and for a batch (gpt-fast's ``speculative_decode``; SpecInfer,
Miao et al. 2024, for trees): lay out each sequence's draft after its uncached context tail, one target forward over
all of them, verify each on its own logits, roll each cache back to its accepted path.

A chain is the tree with parents ``chain_parents(n)`` and is laid out as one: the same rows, the same rollback. It
keeps the causal kernel (no positions, no mask), since the causal mask already is its tree mask; a tree or a draft
with an auxiliary branch gets :func:`specdraft.trees.verify_layout`'s positions and mask. Verification is
:func:`specdraft.verification.verify` (greedy or sampling, chain or tree; lossy only for a draft that carries
BiLD's ``rollback`` threshold); the rollback keeps the accepted nodes
(:func:`roll_back`: a crop when they are contiguous, which a chain's always are).

Where the forward runs is a :class:`StepTarget`: :class:`OneSequence` (a target and its batch-1 cache) here, a batch
of cache rows in :class:`specdraft.batching.BatchRows`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from specdraft.drafters.base import Draft, TargetFeatures
from specdraft.models.base import CausalLM, KVCache
from specdraft.sampling import LogitsProcessor, SamplingConfig, check_finite, checked_argmax
from specdraft.trees import chain_parents, verify_layout
from specdraft.verification import VerifyResult, verify

STEP_ROOM = 256  # cache slots beyond prompt + max_new_tokens for what one step feeds past its tail (nodes, auxiliary)


@dataclass(frozen=True)
class Layout:
    """What one sequence feeds a step's forward: its uncached context tail (the last token is the root), the draft's
    nodes, then the draft's auxiliary tokens.

    tokens: (T,) ids. offsets, mask: (T,) positions past the first fed token and (T, T) bool, or both None for a chain
    (the causal kernel).
    """

    draft: Draft
    tail: int
    tokens: torch.Tensor
    offsets: torch.Tensor | None
    mask: torch.Tensor | None


def lay_out(context: torch.Tensor, cached: int, draft: Draft) -> Layout:
    """The layout of ``draft`` after ``context`` (N,), of which ``cached`` tokens are in the cache already."""
    tail = context[cached:]  # (T0,)
    fed = [tail, draft.tokens] + ([draft.aux.tokens] if draft.aux is not None else [])
    if not draft.is_tree:
        return Layout(draft, tail.shape[0], torch.cat(fed), None, None)
    parents = draft.parents if draft.parents is not None else chain_parents(len(draft))
    offsets, mask = verify_layout(tail.shape[0], parents, draft.aux)  # (T,), (T, T)
    return Layout(draft, tail.shape[0], torch.cat(fed), offsets, mask)


@dataclass(frozen=True)
class StepInput:
    """One sequence's part of a step: its context (N,) long, its draft, its sampling settings and generator, and the
    processor of the target's logits (None: none), which sees the context past ``prompt_length``."""

    context: torch.Tensor
    draft: Draft
    sampling: SamplingConfig
    generator: torch.Generator | None
    processor: LogitsProcessor | None = None
    prompt_length: int = 0


@dataclass(frozen=True)
class StepResult:
    """One sequence's outcome: the verification result (with the target's features of the committed tokens and the
    auxiliary branch's logits, when fed), the accepted draft tokens, and the target's logits (N + 1, V) at the root
    and at every node (after the step's logits processor, when it had one: the logits it verified against)."""

    result: VerifyResult
    accepted: list[int]
    logits: torch.Tensor

    @property
    def tokens(self) -> list[int]:
        """The tokens this step commits: the accepted ones, then the recovered or bonus token."""
        return self.accepted + [self.result.next_token]

    @property
    def verified_logits(self) -> torch.Tensor:
        """(m + 1, V): the target's logits that chose the m accepted tokens and the next one."""
        return self.logits[[0] + [1 + node for node in self.result.accepted_nodes]]


class StepTarget(Protocol):
    """The target and the cache rows one step feeds."""

    def prefill(self, row: int, tokens: torch.Tensor) -> torch.Tensor | None:
        """Feed ``tokens`` (T,) to sequence ``row``'s empty cache on the causal path; returns their features (T, D)
        when its drafter reads them, else None."""
        ...

    def cached(self, row: int) -> int:
        """Positions of sequence ``row`` held in its cache."""
        ...

    def forward(self, layouts: Sequence[Layout]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """One forward over every sequence's layout: per sequence, logits (T_i, V) and its features (T_i, D) when
        its drafter reads them, else None."""
        ...

    def row_cache(self, row: int) -> KVCache:
        """Sequence ``row``'s cache (rolled back after verification)."""
        ...


class OneSequence:
    """A target and its batch-1 cache; ``features``: what the drafter reads from every forward (None: nothing)."""

    def __init__(self, target: CausalLM, cache: KVCache, features: TargetFeatures | None = None) -> None:
        self.target, self.cache = target, cache
        self.features = {} if features is None else features.forward_args()

    def prefill(self, row: int, tokens: torch.Tensor) -> torch.Tensor | None:
        out = self.target.forward(tokens.unsqueeze(0), self.cache, logits_to_keep=1, **self.features)
        return out[1][0] if self.features else None  # (T, D)

    def cached(self, row: int) -> int:
        return self.cache.length

    def row_cache(self, row: int) -> KVCache:
        return self.cache

    def forward(self, layouts: Sequence[Layout]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        (layout,) = layouts
        tree = {} if layout.mask is None else {"positions": self.cache.length + layout.offsets,  # (T,)
                                               "attention_mask": layout.mask}  # (T, T)
        out = self.target.forward(layout.tokens.unsqueeze(0), self.cache, **tree, **self.features)
        return [(out[0][0], out[1][0]) if self.features else (out[0], None)]  # (T, V), (T, D)


def roll_back(cache: KVCache, first_node: int, nodes: Sequence[int]) -> None:
    """Keep the cache up to ``first_node`` (the slot of node 0), then the slots of the accepted ``nodes``: a crop when
    they are the leading nodes, else a compaction that moves them into place."""
    if list(nodes) == list(range(len(nodes))):
        cache.crop(first_node + len(nodes))
    else:
        cache.compact(first_node, [first_node + node for node in nodes])


def settle(cache: KVCache, start: int, layout: Layout, logits: torch.Tensor, features: torch.Tensor | None,
           step: StepInput) -> StepResult:
    """Verify one sequence on its logits (T, V) of the forward that fed ``layout`` at cache slot ``start`` (after
    ``step.processor``, row by row, each row seeing the generated tokens and the draft's path before it), and roll
    its cache back to the accepted path."""
    draft, tail = layout.draft, layout.tail
    rows = logits[tail - 1 : tail + len(draft)]  # (N + 1, V): the root, then every node
    greedy = None  # the rows' argmax, when the check reads them anyway (greedy, nothing after the nodes, as given)
    if step.sampling.greedy and draft.aux is None and step.processor is None and draft.rollback is None:
        greedy = checked_argmax(rows, "target")
    else:
        check_finite(logits[tail - 1 :], "target")
    if step.processor is not None:
        rows = step.processor(rows, step.context[step.prompt_length :], draft.tokens, draft.parents)  # (N + 1, V)
    result = verify(draft.tokens, draft.parents, draft.q, rows, step.sampling, step.generator, draft.rollback,
                    greedy)
    nodes = list(result.accepted_nodes)
    roll_back(cache, start + tail, nodes)
    if draft.aux is not None:
        result = replace(result, aux_logits=logits[tail + len(draft) :])  # (A, V)
    if features is not None:  # the tail's and the accepted nodes': (T0 + m, D)
        result = replace(result, hidden=features[list(range(tail)) + [tail + node for node in nodes]])
    return StepResult(result, draft.tokens[nodes].tolist(), rows)


def speculative_step(target: StepTarget, inputs: Sequence[StepInput], isolate: bool = False
                     ) -> list[StepResult | Exception]:
    """One speculative step of every sequence in ``inputs`` (row i of ``target``): lay out, one target forward,
    verify, roll back. Lossless per sequence (Leviathan et al. 2023, Alg. 1; SpecInfer for trees). With ``isolate``,
    a sequence whose verification raises (non-finite logits, a sampling error) gets its exception in place of its
    result and the others go on (batched serving); without it, the exception propagates."""
    starts = [target.cached(row) for row in range(len(inputs))]
    layouts = [lay_out(step.context, start, step.draft) for step, start in zip(inputs, starts, strict=True)]
    outputs = target.forward(layouts)
    results: list[StepResult | Exception] = []
    for row, (step, layout, (logits, features)) in enumerate(zip(inputs, layouts, outputs, strict=True)):
        try:
            results.append(settle(target.row_cache(row), starts[row], layout, logits, features, step))
        except Exception as exc:
            if not isolate:
                raise
            results.append(exc)
    return results
