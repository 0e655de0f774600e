"""The drafter interface: three verbs, as transformers' ``CandidateGenerator`` plus a start hook.

``begin(target, cache)`` is called once at the start of every generation with the target and its KV cache
(self-speculative drafters draft through them; drafters with per-generation state reset it);
``propose(context, num_draft_tokens, sampling, generator) -> Draft`` drafts a chain of up to ``num_draft_tokens``
tokens, or a token tree no deeper than that, to follow ``context``; ``observe(result)`` tells an adaptive drafter
how verification went. How many tokens a step drafts is decided by the speculation policy
(:func:`specdraft.speculation.propose`), never by the decoding loop or the drafter: a drafter proposes up to what it is
given. A new drafting method is a new file behind this interface.

Three capabilities are optional, each a protocol of its own that a drafter states by implementing it:

- :class:`ReadsTargetFeatures` (Medusa, EAGLE, EAGLE-3): ``target_features()`` names the target features the drafter
  reads (:class:`TargetFeatures`, valid from the end of ``begin``). The loop then asks the verify forward for them and
  passes, in ``result.hidden`` (F, D), those of the F tokens fed this step and committed (the uncached context tail,
  then the accepted draft tokens), in order: the final-normed hidden states, or with ``layers`` (EAGLE-3) the
  residual stream entering those target layers, concatenated (F, k*D).
- :class:`ReadsTargetCache` (GliDe): ``read_target_cache(cache)`` is called right after ``begin`` with the target's
  cache as a :class:`~specdraft.models.base.ReadableKVCache`: at every ``propose`` it holds the keys and values of
  every context token but the last (the verify forward of the last step wrote them, at no extra target cost). A
  decoding path whose cache is not readable refuses such a drafter with a clear error (:func:`share_target_cache`).
- :class:`HintsDraftKind`: ``draft_kind(context, sampling)`` says what the drafter would draft from ``context`` before
  it drafts, so a speculation policy prices different kinds of step apart.

The loop reads them only through :func:`target_features`, :func:`share_target_cache` and :func:`draft_kind`.

What the tools must know of a method before or without running it, each drafter class declares as its ``facts``
(:class:`DrafterFacts`: CPU only, replayable, batchable, reads the target's features or cache), read through
:func:`facts_of`; a class with a ``method`` name is chosen by that name (:mod:`specdraft.drafters.registry`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specdraft.errors import SpecdraftError
from specdraft.models import quantized
from specdraft.models.base import CausalLM, KVCache, ReadableKVCache
from specdraft.sampling import SamplingConfig
from specdraft.trees import AuxBranch, check_tree, most_confident
from specdraft.verification import VerifyResult


@dataclass(frozen=True)
class Draft:
    """A drafted chain or token tree.

    tokens: (N,) long ids, N may be 0 (then the step is plain decoding).
    q: (N, V) draft probabilities after the same warping as p, or None for a deterministic draft, which
       verification treats as a point mass on ``tokens``. In a tree, row i is the distribution node i was drawn
       from (its parent's); siblings that carry q must be independent draws from that same row (SpecInfer).
    parents: None for a chain, else (N,) the tree (see :mod:`specdraft.trees`: -1 = child of the root,
       parents[i] < i).
    aux: tokens fed in the same target forward whose logits come back in ``VerifyResult.aux_logits``.
    confidence: None, or (N,) float: the drafter's own probability for node i, read from the distribution node i
       was drawn from *before* drawing it (its largest probability; for a greedy draft that is q(token)), NaN where
       the drafter has none. Adaptive speculation (:mod:`specdraft.speculation`) learns what it is worth.
    source: None, or (N,) long: a drafter-defined kind of each node (e.g. the n-gram size a copy matched), so that
       acceptance is learned per kind; None = all one kind.
    rollback: None (exact verification), or, for a chain, BiLD's rollback threshold α: verification also keeps a
       token whose distance -log p(token) is at most α (lossy for α > 0; :mod:`specdraft.verification`).
    """

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    parents: torch.Tensor | None = None
    aux: AuxBranch | None = None
    confidence: torch.Tensor | None = None
    source: torch.Tensor | None = None
    rollback: float | None = None

    def __post_init__(self) -> None:
        if self.parents is not None:
            check_tree(self.tokens, self.parents, self.q)
        if self.rollback is not None and (self.is_tree or not self.rollback >= 0):
            raise SpecdraftError(f"a rollback threshold applies to chain drafts and must be >= 0, got "
                                 f"{self.rollback}" + (" on a tree" if self.is_tree else ""))
        for name in ("confidence", "source"):
            value = getattr(self, name)
            if value is not None and value.shape != self.tokens.shape:
                raise SpecdraftError(f"draft {name} must have one value per token, got {tuple(value.shape)} for "
                                     f"{len(self)} tokens")

    def select(self, kept: torch.Tensor, parents: torch.Tensor | None) -> Draft:
        """The nodes ``kept`` (M,) (closed under parents, increasing) with ``parents`` (M,) renumbered, or None
        for a chain prefix; every per-node field follows, the auxiliary branch stays."""
        def pick(value):
            return None if value is None else value[kept]

        return Draft(self.tokens[kept], pick(self.q), parents, self.aux, pick(self.confidence), pick(self.source),
                     self.rollback)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def aux_size(self) -> int:
        """How many auxiliary tokens the step feeds beside the nodes (0 without an auxiliary branch)."""
        return 0 if self.aux is None else int(self.aux.tokens.shape[0])

    @property
    def is_tree(self) -> bool:
        """Whether the decoding loop must take the tree path (a tree, or an auxiliary branch)."""
        return self.parents is not None or self.aux is not None


EMPTY_DRAFT = Draft(torch.empty(0, dtype=torch.long))


@runtime_checkable
class Drafter(Protocol):
    """Anything that proposes draft tokens. ``vocab_size`` / ``max_context`` are None when unconstrained."""

    name: str
    vocab_size: int | None
    max_context: int | None

    def begin(self, target: CausalLM, cache: KVCache) -> None:
        """A generation starts: ``target`` and its (empty) ``cache`` serve it. Most drafters ignore them."""
        ...

    def propose(
        self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Draft:
        """Draft at most ``num_draft_tokens`` tokens to follow ``context`` ((N,) long, the whole sequence so far)."""
        ...

    def observe(self, result: VerifyResult) -> None:
        """Feedback after verification (adaptive drafters use it; others ignore it)."""
        ...


@dataclass(frozen=True)
class TargetFeatures:
    """The target features a drafter reads: the final-normed hidden states (``layers`` empty; Medusa, EAGLE), or the
    residual stream entering each of ``layers``, concatenated (EAGLE-3)."""

    layers: tuple[int, ...] = ()

    def forward_args(self) -> dict:
        """The keyword arguments of :meth:`~specdraft.models.base.CausalLM.forward` that return these features."""
        return {"return_hidden": True} | ({"hidden_layers": self.layers} if self.layers else {})


@runtime_checkable
class ReadsTargetFeatures(Protocol):
    """Optional capability: the drafter reads the target's features of the committed tokens (module docstring)."""

    def target_features(self) -> TargetFeatures | None:
        """The features to return with every verify forward (None: none after all, e.g. a combination whose parts
        read none). Valid from the end of ``begin``."""
        ...


@runtime_checkable
class ReadsTargetCache(Protocol):
    """Optional capability: the drafter reads the target's KV cache (module docstring)."""

    def read_target_cache(self, cache: ReadableKVCache) -> None:
        """This generation's target cache, to read at every ``propose`` (never to write or crop); called right after
        ``begin``."""
        ...


@runtime_checkable
class HintsDraftKind(Protocol):
    """Optional capability: the drafter says what it would draft before drafting (module docstring)."""

    def draft_kind(self, context: torch.Tensor, sampling: SamplingConfig) -> Hashable:
        """What the drafter would draft next from ``context`` (None: no hint): steps of one kind share a drafting
        cost and an acceptance profile (:mod:`specdraft.speculation`). It must depend only on the context, never on
        a draw, so a policy reading it keeps output exact."""
        ...


@dataclass(frozen=True)
class DrafterFacts:
    """What the command line, the bench, greedy replay and batched decoding need to know of a drafting method before
    (or instead of) running it. A drafter class declares its own as the class attribute ``facts``."""

    cpu_only: bool = False  # drafts on the CPU beside a CPU target (reads the target's weights there)
    replayable: bool = False  # proposals are a function of the context alone: greedy replay gives its exact τ
    batchable: bool = True  # runs in batched decoding (needs no access to the target's KV cache)
    reads_target_features: bool = False  # implements ReadsTargetFeatures
    reads_target_cache: bool = False  # implements ReadsTargetCache, or drafts through the target's cache
    one_forward_draft: bool = False  # one forward drafts any length (DFlash): priced per draft, not per token


def int8_drafting(method: str, quantize: str) -> bool:
    """A head drafter's ``quantize`` option -> whether it drafts on specdraft's int8 kernels: ``auto`` where they
    run, ``int8`` (refused where they cannot run), ``none`` never."""
    if quantize not in ("auto", "int8", "none"):
        raise SpecdraftError(f"{method} option quantize must be auto, int8 or none, got {quantize!r}")
    if quantize == "int8" and not quantized.available():
        raise SpecdraftError(f"{method} quantize=int8 needs specdraft's int8 kernels, which cannot run here (an x86 "
                             "CPU with AVX2, FMA and F16C and a C++ compiler)")
    return quantize != "none" and quantized.available()


def check_feature_target(what: str, target, embed: torch.Tensor, vocab_size: int, hidden: int,
                         read_layers: Sequence[int], named_layers: Sequence[int]) -> None:
    """A clear error where a head that embeds with the target's table and reads its residual stream entering
    ``read_layers`` does not fit ``target`` (its embeddings ``embed``); ``named_layers``: the layers as the head's
    settings name them, for the message."""
    name = getattr(target, "name", "?")
    if tuple(embed.shape) != (vocab_size, hidden):
        raise SpecdraftError(f"{what} head mismatch: trained for vocabulary {vocab_size} and hidden size {hidden}, "
                             f"target {name!r} has embeddings {tuple(embed.shape)}")
    layers = getattr(getattr(target, "config", None), "num_hidden_layers", None)
    if layers is not None and max(read_layers) >= layers:
        raise SpecdraftError(f"{what} head reads target layers {list(named_layers)}, target {name!r} has {layers}")


def confident_tree(tokens: list[int], parents: list[int], scores: list[float], limit: int,
                   q: torch.Tensor | None) -> Draft:
    """A grown tree cut to its ``limit`` most confident nodes, closed under ancestors, in node order (EAGLE-2's
    re-ranking): ``scores`` are cumulative draft log-probabilities, ``q`` (N, V) the row each node was drawn from, or
    None (a deterministic tree). Each kept node's confidence is q(node | parent)."""
    kept, kept_parents = most_confident(parents, scores, limit)  # (M,) each
    score, parent = torch.tensor(scores, dtype=torch.float32), torch.tensor(parents, dtype=torch.long)  # (N,) each
    confidence = (score - torch.where(parent >= 0, score[parent.clamp_min(0)], 0.0)).exp()  # (N,)
    return Draft(torch.tensor(tokens, dtype=torch.long)[kept], None if q is None else q[kept], kept_parents, None,
                 confidence[kept])


@dataclass(frozen=True)
class CatchUp:
    """A draft model's first forward of a draft: it reads the context the drafter has not seen (the prompt, or the
    tokens committed since it last drafted) and gives the first draft token. ``fresh``: it read a new sequence's
    prompt (its first forward since ``begin``: the whole context, or all of it past a prefix the previous sequence
    shared, such as a chat template's system turn). Adaptive speculation prices it as a cost per drafting step,
    apart from the tokens after it, unless it is fresh: a prompt's read is prefill. ``tokens``: how many it read
    (after a run of plain or copy steps, several)."""

    started: float  # time.perf_counter() when the forward began
    seconds: float
    fresh: bool
    tokens: int = 1


def catch_up(drafter, since: float) -> CatchUp | None:
    """The catch-up forward ``drafter`` (or the drafter a combination wraps) ran at ``since`` or later, or None."""
    while drafter is not None:
        record = getattr(drafter, "last_catch_up", None)
        if isinstance(record, CatchUp):
            return record if record.started >= since else None
        drafter = getattr(drafter, "inner", None)
    return None


def facts_of(drafter) -> DrafterFacts:
    """The facts a drafter (an instance or its class) declares; a drafter that declares none gets the defaults (not
    replayable, batchable as far as anyone knows)."""
    facts = getattr(drafter, "facts", None)
    return facts if isinstance(facts, DrafterFacts) else DrafterFacts()


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """The length of the longest prefix token ids ``a`` (N,) and ``b`` (M,) share: the common case (one extends
    the other) in one comparison, no index tensor."""
    size = min(a.shape[0], b.shape[0])
    if torch.equal(a[:size], b[:size]):
        return size
    return int((a[:size] != b[:size]).nonzero()[0])


def grown_cache(cache: KVCache | None, needed: int, new_cache: Callable[[int], KVCache],
                limit: int | None = None) -> KVCache | None:
    """A drafter's own cache growth, one rule for all: None while ``cache`` holds ``needed`` positions, else a new
    cache of twice that (at least 256, at most ``limit``), so that growing stays rare. The caller starts the new
    cache empty."""
    if cache is not None and cache.capacity >= needed:
        return None
    size = max(2 * needed, 256)
    return new_cache(size if limit is None else min(size, limit))


def target_features(drafter: Drafter) -> TargetFeatures | None:
    """The features ``drafter`` reads (:class:`ReadsTargetFeatures`), or None."""
    return drafter.target_features() if isinstance(drafter, ReadsTargetFeatures) else None


def share_target_cache(drafter: Drafter, cache: KVCache) -> None:
    """Give a drafter that reads the target's cache (:class:`ReadsTargetCache`) read access to ``cache``; a cache
    without that access is a clear error naming the drafter. Other drafters are left alone."""
    if not isinstance(drafter, ReadsTargetCache):
        return
    if not callable(getattr(type(cache), "layer_kv", None)):  # the type's, so a stand-in's __getattr__ is not asked
        raise SpecdraftError(f"drafter {drafter.name!r} reads the target's KV cache, which this decoding path does "
                             f"not expose ({type(cache).__name__}); use batch-1 decoding (specdraft generate)")
    drafter.read_target_cache(cache)


def draft_kind(drafter: Drafter, context: torch.Tensor, sampling: SamplingConfig) -> Hashable:
    """The drafter's hint of what it would draft next from ``context`` (:class:`HintsDraftKind`), or None. Asked
    every step, so the capability is looked up as an attribute (what ``isinstance`` against the runtime-checkable
    protocol checks, at a twentieth of its cost)."""
    hint = getattr(drafter, "draft_kind", None)
    return hint(context, sampling) if callable(hint) else None


class NoDrafter:
    """Proposes nothing: the decoding loop then runs plain autoregressive decoding, one target forward a token."""

    facts = DrafterFacts(replayable=True)
    name = "ar"
    vocab_size = None
    max_context = None

    def begin(self, target: CausalLM, cache: KVCache) -> None:
        pass

    def propose(self, context, num_draft_tokens, sampling, generator) -> Draft:
        return EMPTY_DRAFT

    def observe(self, result: VerifyResult) -> None:
        pass
