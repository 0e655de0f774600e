"""How much to speculate each step: a fixed γ, or adaptive speculation priced by the machine's cost model.

:func:`propose` is the one place that decides how many tokens a step drafts; every decoding loop calls it once per
step. It asks the step's :class:`SpeculationPolicy`

- ``budget(context_length, limit, kind, sequences)``: how many draft tokens (depth) to ask the drafter for; 0 = a
  plain step; ``sequences`` share the step's forward (1 in batch-1 decoding).
  ``kind`` is the drafter's hint of what it would draft from this context before drafting
  (:func:`~specdraft.drafters.base.draft_kind`: a prompt-lookup drafter's matched n-gram size, a combined drafter's
  "copy alone" or "model chain"), so steps that differ in cost and acceptance are priced apart;
- ``trim(draft, ..., sequences)``: which drafted nodes to verify (a prefix of a chain, an ancestor-closed subset of a
  tree);

and then fits the draft to what the step can feed (:func:`fit`: no deeper than the budget, within the cache's room
and the model's positions). After verification the loop tells the policy what happened:
``observe(draft, result, draft_seconds, verify_seconds)``.

Only how much is proposed changes, so output stays exact: greedy verification returns the target's argmax
whatever is proposed, and speculative sampling is exact for any draft length that is a stopping time of the
drafting process (Leviathan et al. 2023; SpecDec++, Huang et al. 2024): whether node i+1 is verified may depend on
nodes 1..i and on the past, never on node i+1's own draw. A node's ``Draft.confidence`` is read from the
distribution it was drawn from before the draw (its largest probability), so it qualifies; when sampling, chains
are cut by a sequential stop that looks at one node more only through that value, and trees are not cut.

:class:`AdaptivePolicy` maximises expected tokens per second. With a_i the learned probability that node i is
accepted once its parent is, node i is accepted with P_i = prod of a_j on its path, and verifying a node set S
yields E[tokens] = 1 + sum_{i in S} P_i (the recovered or bonus token included; Leviathan et al. 2023, eq. 1, with
per-node rates as in SpecInfer and EAGLE-2's tree value). It costs the drafting time plus c(T0 + |S|, L), the
target's forward over the T0 uncached tokens and |S| draft nodes at context L, read from the measured
:class:`~specdraft.costs.CostCurve`. Prior adaptive schemes stop drafting when a rejection grows likely (SpecDec++:
a threshold on the predicted rejection probability; AdaEDL: an entropy bound; DISCO: a learned classifier; vLLM:
profiled per-batch costs with a constant per-token verify cost); none prices how the verify cost itself grows with
the number of verified tokens, which on CPUs without fast skinny GEMMs is what decides.

In a batch of n sequences every row of the verify forward is padded to the longest, so a sequence that drafts d
tokens is priced as if every row fed as many: its share of the forward is c(n (T0 + d), L) / n, against
c(n T0, L) / n for a plain step. Batching is speculation's rival for the same idle compute (Liu et al. 2024,
"Optimizing Speculative Decoding for Serving Large Language Models Using Goodput"): where n rows already fill the
machine, drafting stops paying, and the policy stops drafting at that batch size by itself; its verify-cost scale
is learned from the batch's measured forwards. ``max_sequences`` (both policies) is a fixed cut instead, as vLLM's
``speculative_disable_by_batch_size``: no drafting in steps of more sequences.

The confidence-to-acceptance map is learned online: counts of accepted / reached nodes per (source, confidence
decile) or, for nodes without a confidence (prompt lookup, REST, Lookahead, heads), per (source, depth), with a
Beta prior at the confidence itself (or 0.5). What drafting costs besides a draft model's catch-up is learned from
the loop's timings as a line in the depth (:class:`Line`: a draft model's first token comes with its catch-up, each
further one costs a forward, so an average per token overprices short drafts and underprices long ones), as the
average per requested token until the depths drafted vary; a drafter whose one forward drafts any length (DFlash's
block, ``DrafterFacts.one_forward_draft``) is priced per draft instead, so deeper drafts cost it nothing more. The
measured verify curve is corrected by two learned factors: a scale on the whole forward (a shared CPU's load
drifts) and a slope on what tokens beyond a plain step's add (a calibration taken once on a noisy machine can price
them far from what the loop then measures: on a 2-core AMD EPYC Zen 3 its curve had a 3-token forward at 1.27x a
step where the loop's forwards took 1.12-1.15x, and the policy verified too little). A draft model's first forward
of a step reads every token committed since it last drafted (after a run of copy or plain steps, several), so it is
learned apart (:class:`~specdraft.drafters.base.CatchUp`; the read of a new sequence's prompt is prefill and not
learned): priced per token, it made a 1-token draft look as dear per token as the forward itself and priced deeper
drafts out. It is learned as a line in the tokens it read, and a drafting step is priced at the line's one-token
catch-up: the tokens behind are read whenever the model drafts next, so they are no cost of drafting now. Priced at
the average catch-up, the tokens read after runs of plain steps made drafting look dearer, which made the runs
longer. The per-depth
acceptance that ``budget`` prices before drafting, the drafting costs and the verified nodes per depth are
learned per draft kind: a draft model whose context holds a long prompt-lookup match copies at no drafting cost and
is usually right, while its own chain costs a forward a token and, on a summary of a long article, is mostly wrong;
pooled, the copy steps would talk the policy into paying for chains that do not pay. A drafter whose drafts carry
auxiliary tokens (Lookahead's Jacobi window, fed in the verify forward whatever is kept of the nodes) has their
number learned per kind too and priced into ``budget``: priced by its nodes alone, a Lookahead step of 2-3 nodes
looked like a 3-4-token forward while it fed 15 more (its default window), and a calibration that happened to
price large forwards low turned a policy that mostly declined Lookahead into one that drafted it every other step,
at 3.5 plain steps each.
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import torch

from specdraft.costs import CostCurve
from specdraft.drafters.base import EMPTY_DRAFT, CatchUp, Draft, Drafter, catch_up, draft_kind
from specdraft.sampling import SamplingConfig
from specdraft.trees import chain_parents, depth_list, depths, keep_nodes
from specdraft.verification import VerifyResult

_PRIOR_WEIGHT = 2.0  # pseudo-observations behind each bucket's prior
_MAX_WEIGHT = 200.0  # counts are halved beyond this, so the map follows drift
_MAX_DEPTH_KEY = 8  # depths beyond this share a bucket
_EMA = 0.1  # weight of the newest timing in the moving averages
_EXPLORE_EVERY = 8  # after at least this many plain steps in a row, one draft keeps the estimates alive
_EXPLORE_LOSS = 0.02  # ... and no sooner than where the exploring step's excess over a plain step is this share of the
# time: a draft that never pays costs at most this much
_MIN_SPREAD = 0.05  # the least variance of x (tokens) over which a Line fits a slope


@runtime_checkable
class SpeculationPolicy(Protocol):
    """Decides, step by step, how much to propose (see the module docstring)."""

    def budget(self, context_length: int, limit: int, kind: Hashable = None, sequences: int = 1) -> int:
        """Draft tokens (chain length or tree depth) to ask for, 0 .. ``limit``; 0 = a plain step. ``kind``: the
        drafter's hint of what it would draft (:func:`specdraft.drafters.base.draft_kind`), None without one;
        ``sequences``: how many sequences share the step's forward."""
        ...

    def trim(self, draft: Draft, context_length: int, tail: int, draft_seconds: float, greedy: bool,
             sequences: int = 1) -> Draft:
        """The part of ``draft`` to verify; ``tail`` uncached context tokens are fed with it."""
        ...

    def note_catch_up(self, record: CatchUp | None) -> None:
        """This step's draft-model catch-up forward (:func:`~specdraft.drafters.base.catch_up`), None without one."""
        ...

    def observe(self, draft: Draft, result: VerifyResult, draft_seconds: float, verify_seconds: float) -> None:
        """``draft`` (as verified) and its ``result``, with the step's timings."""
        ...


class FixedPolicy:
    """Always γ = ``num_draft_tokens``, everything drafted is verified (the classic setting); none in steps of more
    than ``max_sequences`` sequences, when set."""

    def __init__(self, num_draft_tokens: int, max_sequences: int = 0) -> None:
        self.num_draft_tokens, self.max_sequences = num_draft_tokens, max_sequences

    def budget(self, context_length: int, limit: int, kind: Hashable = None, sequences: int = 1) -> int:
        if self.max_sequences and sequences > self.max_sequences:
            return 0
        return min(self.num_draft_tokens, limit)

    def trim(self, draft: Draft, context_length: int, tail: int, draft_seconds: float, greedy: bool,
             sequences: int = 1) -> Draft:
        return draft

    def note_catch_up(self, record: CatchUp | None) -> None:
        pass

    def observe(self, draft: Draft, result: VerifyResult, draft_seconds: float, verify_seconds: float) -> None:
        pass


def _key(source: int, confidence: float, depth: int) -> tuple[int, str, int]:
    if math.isnan(confidence):
        return source, "depth", min(depth, _MAX_DEPTH_KEY)
    return source, "q", min(int(confidence * 10), 9)


class AcceptanceMap:
    """P(node accepted | its parent accepted) per bucket, learned online (Beta-smoothed counts)."""

    def __init__(self) -> None:
        self.counts: dict[tuple, list[float]] = {}  # key -> [accepted, reached]

    def rate(self, key: tuple) -> float:
        prior = (key[2] + 0.5) / 10 if key[1] == "q" else 0.5
        accepted, reached = self.counts.get(key, (0.0, 0.0))
        return (accepted + _PRIOR_WEIGHT * prior) / (reached + _PRIOR_WEIGHT)

    def update(self, key: tuple, accepted: bool) -> None:
        counts = self.counts.setdefault(key, [0.0, 0.0])
        counts[0] += accepted
        counts[1] += 1
        if counts[1] > _MAX_WEIGHT:
            counts[0], counts[1] = counts[0] / 2, counts[1] / 2


def _node_keys(draft: Draft) -> tuple[list[tuple], list[int], list[int]]:
    """Each node's bucket, parent and depth, as lists (a chain's without building its parents: the policy asks
    twice a step)."""
    size = len(draft)
    if draft.parents is None:
        parents, node_depths = list(range(-1, size - 1)), list(range(1, size + 1))
    else:
        parents = draft.parents.tolist()
        node_depths = depth_list(parents)
    confidence = draft.confidence.tolist() if draft.confidence is not None else [math.nan] * size
    source = draft.source.tolist() if draft.source is not None else [0] * size
    return [_key(s, c, d) for s, c, d in zip(source, confidence, node_depths, strict=True)], parents, node_depths


def depth_key(depth: int, kind: Hashable) -> tuple:
    """The bucket of "the deepest accepted level reaches ``depth``" for steps of draft ``kind``."""
    return -1, "depth", min(depth, _MAX_DEPTH_KEY), kind


@dataclass
class Line:
    """y = intercept + slope x (x >= 0) through recent observations: a least-squares line over moving sums of 1, x, y,
    x² and xy (their ratios are the weighted means); ``slope`` stays None while the x seen barely vary."""

    intercept: float = 0.0
    slope: float | None = None
    sums: tuple[float, ...] = (0.0,) * 5

    def add(self, x: float, y: float) -> None:
        self.sums = tuple(m + _EMA * (v - m) for m, v in zip(self.sums, (1.0, x, y, x * x, x * y), strict=True))
        mx, my, mxx, mxy = (value / self.sums[0] for value in self.sums[1:])
        spread = mxx - mx * mx
        if spread > _MIN_SPREAD:  # never negative, never so steep that the intercept would be
            self.slope = min(max((mxy - mx * my) / spread, 0.0), my / mx)
        self.intercept = max(my - (self.slope or 0.0) * mx, 0.0)


@dataclass
class _KindState:
    """What :class:`AdaptivePolicy` learns per draft kind besides acceptance."""

    draft_seconds_per_token: float = 0.0  # moving average per requested token (per draft: one_forward_draft); the
    # price of drafting until the depths drafted vary
    drafting: Line = field(default_factory=Line)  # drafting seconds beyond the catch-up against depth - 1
    catch_up: Line = field(default_factory=Line)  # a draft model's first forward against the tokens it read - 1
    nodes_per_depth: float = 1.0  # moving average of verified nodes per requested depth
    aux_tokens: float = 0.0  # moving average of the auxiliary tokens its drafts feed beside their nodes (Lookahead's
    # Jacobi window), fed whatever the policy keeps of the nodes
    plain_run: int = 0  # plain steps in a row (exploration, _EXPLORE_EVERY)


class AdaptivePolicy:
    """Adaptive speculation: each step, the draft size that maximises expected tokens per second, 0 included.

    ``target_costs`` is the target's measured forward-cost curve; ``max_draft_tokens`` bounds the depth;
    ``max_sequences`` > 0: no drafting in steps of more sequences (module docstring).
    """

    def __init__(self, target_costs: CostCurve, max_draft_tokens: int, draft_seconds_per_token: float = 0.0,
                 max_sequences: int = 0, one_forward_draft: bool = False) -> None:
        self.costs = target_costs
        self.max_draft_tokens, self.max_sequences = max_draft_tokens, max_sequences
        self.one_forward_draft = one_forward_draft  # a draft of any length costs one forward: price it per draft
        self.acceptance = AcceptanceMap()
        self.initial_draft_seconds = draft_seconds_per_token
        self.kinds: dict[Hashable, _KindState] = {}  # per draft kind: drafting cost, nodes per depth, plain run
        self.verify_scale = 1.0  # moving average of measured / predicted verify seconds
        self._excess = self._extra = 0.0  # moving sums: measured and curve cost of tokens beyond a plain step's
        self._asked = 0
        self._context = 0
        self._sequences = 1
        self._kind: Hashable = None
        self._catch_up: CatchUp | None = None  # this step's draft-model catch-up forward (note_catch_up)

    def _state(self, kind: Hashable) -> _KindState:
        if kind not in self.kinds:
            self.kinds[kind] = _KindState(self.initial_draft_seconds)
        return self.kinds[kind]

    @property
    def verify_slope(self) -> float:
        """What tokens beyond a plain step's cost, measured, against what the curve says they cost (1 until a verify
        of more tokens than a plain step has been measured)."""
        return self._excess / self._extra if self._extra > 0 else 1.0

    def _verify_seconds(self, new_tokens: int, context_length: int, sequences: int = 1) -> float:
        """Predicted seconds of this sequence's share of a verify forward in which each of ``sequences`` rows feeds
        ``new_tokens`` (module docstring)."""
        return self._forward_seconds(sequences * new_tokens, sequences, context_length) / sequences

    def _curve_parts(self, tokens: int, rows: int, context_length: int) -> tuple[float, float]:
        """The curve's price of a plain step of ``rows`` sequences, and what a forward of ``tokens`` adds to it."""
        plain = self.costs.seconds(rows, context_length)
        return plain, max(self.costs.seconds(tokens, context_length) - plain, 0.0)

    def _drafting_seconds(self, state: _KindState, depth: int) -> float:
        """Drafting seconds of a ``depth``-token draft besides the catch-up: the line through the depths drafted so
        far, or while they have not varied, the average per requested token (per draft: one_forward_draft)."""
        if self.one_forward_draft:
            return state.draft_seconds_per_token
        if state.drafting.slope is None:
            return state.draft_seconds_per_token * depth
        return state.drafting.intercept + state.drafting.slope * (depth - 1)

    def _forward_seconds(self, tokens: int, rows: int, context_length: int) -> float:
        """Predicted seconds of a forward of ``tokens`` new tokens over ``rows`` sequences: the curve's plain step and
        its extra tokens, the extra tokens at the learned slope, all at the learned scale (module docstring)."""
        plain, extra = self._curve_parts(tokens, rows, context_length)
        return self.verify_scale * (plain + self.verify_slope * extra)

    def budget(self, context_length: int, limit: int, kind: Hashable = None, sequences: int = 1) -> int:
        """The depth with the best expected rate under the per-depth acceptance seen so far for this ``kind``."""
        limit = min(limit, self.max_draft_tokens)
        if self.max_sequences and sequences > self.max_sequences:
            limit = 0
        state = self._state(kind)
        plain = self._verify_seconds(1, context_length, sequences)
        best, best_rate, expected, reach, first = 0, 1.0 / plain, 1.0, 1.0, plain
        for depth in range(1, limit + 1):
            reach *= self.acceptance.rate(depth_key(depth, kind))
            expected += reach
            nodes = max(depth, round(state.nodes_per_depth * depth))
            drafting = state.catch_up.intercept + self._drafting_seconds(state, depth)
            seconds = drafting + self._verify_seconds(1 + nodes + round(state.aux_tokens), context_length, sequences)
            if depth == 1:
                first = seconds  # the exploring step's price
            if expected / seconds > best_rate:
                best, best_rate = depth, expected / seconds
        if best == 0 and limit > 0:
            state.plain_run += 1
            # a bounded share of the time lost, not of the steps: a dear exploring step (a window of auxiliary
            # tokens) waits until its excess over a plain step is _EXPLORE_LOSS of the run's time
            excess = max(first / plain, 1.0) - 1.0  # in plain steps
            if state.plain_run >= max(_EXPLORE_EVERY, excess / _EXPLORE_LOSS - excess - 1.0):
                best, state.plain_run = 1, 0
        else:
            state.plain_run = 0
        self._asked, self._context, self._kind, self._sequences = best, context_length, kind, sequences
        return best

    def trim(self, draft: Draft, context_length: int, tail: int, draft_seconds: float, greedy: bool,
             sequences: int = 1) -> Draft:
        if len(draft) == 0 or (not greedy and draft.parents is not None):
            return draft  # sampled trees: cutting siblings by their draws would bias them (module docstring)
        keys, parents, _ = _node_keys(draft)
        rates = [self.acceptance.rate(key) for key in keys]
        reach = []
        for node, parent in enumerate(parents):
            reach.append(rates[node] * (reach[parent] if parent >= 0 else 1.0))
        extra = draft.aux_size

        def rate(size: int, expected: float) -> float:
            return expected / (draft_seconds + self._verify_seconds(tail + size + extra, context_length, sequences))

        if draft.parents is None and not greedy:
            return draft.select(torch.arange(sequential_stop(reach, rate)), None)
        order = sorted(range(len(draft)), key=lambda node: (-reach[node], node))  # parents before children
        best, best_rate, expected = 0, rate(0, 1.0), 1.0
        for size, node in enumerate(order, start=1):
            expected += reach[node]
            if rate(size, expected) > best_rate:
                best, best_rate = size, rate(size, expected)
        if best == len(draft):
            return draft
        if best == 0 and draft.aux is None:
            return EMPTY_DRAFT
        if draft.parents is None:  # a chain's nodes by reach are its prefix: reach never grows along it
            return draft.select(torch.arange(best), None)
        keep = torch.zeros(len(draft), dtype=torch.bool)
        keep[order[:best]] = True
        kept, new_parents = keep_nodes(draft.parents, keep)
        return draft.select(kept, new_parents)

    def observe(self, draft: Draft, result: VerifyResult, draft_seconds: float, verify_seconds: float) -> None:
        """Update the acceptance map from the nodes verification reached, and the timing averages."""
        keys, parents, node_depths = _node_keys(draft)
        accepted = set(result.accepted_nodes)
        for node, parent in enumerate(parents):
            if parent < 0 or parent in accepted:  # reached: its parent was accepted
                self.acceptance.update(keys[node], node in accepted)
        self._learn_depths(node_depths, accepted)
        if self._asked > 0:
            state = self._state(self._kind)
            caught = self._catch_up
            if caught is not None:  # the first forward apart: a cost per step, the rest per token
                if not caught.fresh:  # a new sequence's first forward reads its whole prompt: prefill, not drafting
                    state.catch_up.add(caught.tokens - 1, caught.seconds)
                draft_seconds = max(draft_seconds - caught.seconds, 0.0)
            per = draft_seconds if self.one_forward_draft else draft_seconds / self._asked
            state.draft_seconds_per_token += _EMA * (per - state.draft_seconds_per_token)
            if not self.one_forward_draft:  # priced per draft by the average: no line to learn
                state.drafting.add(self._asked - 1, draft_seconds)
            state.nodes_per_depth += _EMA * (len(draft) / self._asked - state.nodes_per_depth)
            state.aux_tokens += _EMA * (draft.aux_size - state.aux_tokens)
        self._learn_verify(self._sequences * (1 + len(draft) + draft.aux_size), verify_seconds)  # every token fed
        self._catch_up = None

    def _learn_verify(self, tokens: int, seconds: float) -> None:
        """The scale from every step's measured forward (the whole forward, every row), the slope from the steps
        that fed more tokens than a plain step: what they cost beyond the scaled plain step, against the curve's
        extra."""
        plain, extra = self._curve_parts(tokens, self._sequences, self._context)
        predicted = plain + self.verify_slope * extra
        if predicted <= 0 or seconds <= 0:
            return
        ratio = min(max(seconds / predicted, 0.5), 3.0)
        self.verify_scale += _EMA * (ratio - self.verify_scale)
        if extra > 0.02 * plain:  # a ratio of moving sums: a verify of more tokens (a larger extra) weighs more
            excess = min(max(seconds / self.verify_scale - plain, 0.0), 4.0 * extra)
            self._excess += _EMA * (excess - self._excess)
            self._extra += _EMA * (extra - self._extra)

    def note_catch_up(self, record: CatchUp | None) -> None:
        """This step's draft-model catch-up forward (:func:`~specdraft.drafters.base.catch_up`), read by
        :meth:`observe`."""
        self._catch_up = record

    def _learn_depths(self, node_depths: list[int], accepted: set[int]) -> None:
        """Per-depth acceptance of the deepest reached level (what ``budget`` prices before drafting), from the
        drafted nodes' depths."""
        if not node_depths:
            return
        deepest = max((node_depths[n] for n in accepted), default=0)
        for depth in range(1, min(max(node_depths), deepest + 1) + 1):
            self.acceptance.update(depth_key(depth, self._kind), depth <= deepest)


def sequential_stop(reach: list[float], rate) -> int:
    """Chain length for sampling: node i+1 is kept while the best rate reachable by extending (assuming later
    nodes keep node i+1's rate, which is known before node i+1 is drawn) beats stopping. A stopping time."""
    expected = 1.0
    for size in range(len(reach)):
        step = reach[size] / max(reach[size - 1] if size else 1.0, 1e-12)  # a_{size+1}
        future, best_future, gain = expected, 0.0, reach[size]
        for extra in range(1, len(reach) - size + 1):
            future += gain
            best_future = max(best_future, rate(size + extra, future))
            gain *= step
        if best_future <= rate(size, expected):
            return size
        expected += reach[size]
    return len(reach)


@dataclass(frozen=True)
class StepBounds:
    """What one step can verify, whatever the policy wants: ``limit`` draft tokens (the answer's tokens left after
    the step's own one), ``room`` nodes and auxiliary tokens in the cache, ``max_position`` positions past the root
    within the model's context; ``sequences`` share the step's forward (the policy prices the step by it)."""

    limit: int
    room: int
    max_position: int
    sequences: int = 1


def propose(policy: SpeculationPolicy, drafter: Drafter, context: torch.Tensor, cached: int, bounds: StepBounds,
            sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
    """The draft one step verifies after ``context`` (N,), ``cached`` of whose tokens the target's cache holds: the
    policy's budget for the drafter's kind of step, the drafter's proposal of up to that many tokens, the part the
    policy keeps, fitted to ``bounds``."""
    start = time.perf_counter()
    length = context.shape[0]
    budget = policy.budget(length, bounds.limit, draft_kind(drafter, context, sampling), bounds.sequences)
    draft = drafter.propose(context, budget, sampling, generator) if budget > 0 else EMPTY_DRAFT
    policy.note_catch_up(catch_up(drafter, start) if budget > 0 else None)
    draft = policy.trim(draft, length, length - cached, time.perf_counter() - start, sampling.greedy,
                        bounds.sequences)
    return fit(draft, budget, bounds.room, bounds.max_position)


def fit(draft: Draft, max_depth: int, room: int, max_position: int) -> Draft:
    """``draft`` without the nodes deeper than ``max_depth`` or beyond ``room`` nodes, and without an auxiliary
    branch that does not fit in the cache or lies past the model's last position. Node order keeps the result a
    tree; a chain stays a chain, a tree or a draft with an auxiliary branch carries its parents from here on."""
    if not draft.is_tree:
        return draft if len(draft) <= max_depth else draft.select(torch.arange(max_depth), None)
    aux = draft.aux
    too_far = aux is not None and aux.offsets.numel() > 0 and int(aux.offsets.max()) > max_position
    if aux is not None and (len(draft) + aux.tokens.shape[0] > room or too_far):
        aux = None
    parents = draft.parents if draft.parents is not None else chain_parents(len(draft))
    keep = (depths(parents) <= max_depth) & (torch.arange(len(draft)) < room)
    if bool(keep.all()):
        return replace(draft, parents=parents, aux=aux)
    kept, parents = keep_nodes(parents, keep)
    return replace(draft.select(kept, parents), aux=aux)


SPECULATION = ("adaptive", "fixed")

