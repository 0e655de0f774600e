"""Drafters that combine others: prompt lookup, copies and runners-up joined to a draft model by composition.

- :class:`WithPromptLookup` (LLMA, Yang et al. 2023; Saxena 2023): the continuation of the context's last n-gram,
  found by a :class:`~specdraft.drafters.prompt_lookup.PromptLookupDrafter`, is verified beside the inner drafter's
  draft in the same target forward, as a second branch of a token tree (:func:`specdraft.trees.insert_path`), so a
  step keeps the longer of the two accepted prefixes: a model drafting chat and a copy of the article in a summary
  or a retrieved passage each cover what the other misses. With ``alone`` = m > 0, a match of at least m tokens that
  yields a full γ-token copy is drafted alone and the inner drafter is not asked that step (the choice depends on
  the context only). Greedy only: when sampling, siblings must be independent draws from one distribution
  (SpecInfer) and a copied branch is not, so the inner drafter drafts alone.
- :class:`WithNGramTable`: where the context ends in an n-gram of at least m tokens (``ngram_min_order``) that the
  :class:`~specdraft.drafters.ngram.NGramDrafter` can draft from (a copy of an earlier occurrence in the context, or
  an n-gram of the target's own answers in its table), its chain is drafted alone and the draft model is not run;
  elsewhere the inner drafter drafts. The choice depends on the context only. Greedy only, as the copied branch.
- :class:`WithChainCopies`: at every depth of a draft model's chain where the context so far (with the tokens
  already drafted) ends in an n-gram seen earlier in it, n from max(m, 4) down to m, the token that followed its most
  recent occurrence is drafted instead of the model's, as retrieval and a small model take turns in SAM-Decoding (Hu
  et al. 2024, arXiv 2411.10666); elsewhere the model drafts. A copied token needs no draft forward (the model
  catches up in one forward over the copied tokens when it drafts again). On SmolLM2's greedy answers to Spec-Bench
  questions, teacher-forced, a copy after a match of two or more tokens was right more often than the two-layer
  drafter's argmax, and a copy after a single token less often (docs/onpolicy.md), so m = 2 is the setting to start
  from. Whether a depth copies depends only on the context and the tokens drawn before it, so the draft length and q
  stay a stopping time of the drafting process: greedy, the copy is a deterministic token; sampling, its q row is a
  point mass on it (accepted with probability p(token), the rest resampled from the residual), which is lossless
  under speculative sampling's rule.
- :class:`WithContextWindow`: the model reads a sequence's first :data:`SINK_TOKENS` tokens and, from where its
  prompt's last W - :data:`SINK_TOKENS` tokens began, the rest (W tokens of a long prompt, growing with the answer),
  as StreamingLLM keeps attention sinks and recent tokens (Xiao et al. 2024, arXiv 2309.17453); the tokens between
  are never fed and positions stay contiguous in the draft cache. A long prompt's read by the draft model, about
  0.15 ms a token for the shipped drafter on a 2-core AMD EPYC, costs W tokens' instead. The combinations outside it
  (copies, prompt lookup) read the whole context.
- :class:`WithSiblings`: greedy, at every depth the chain reaches, the k next most likely draft tokens join the tree
  as leaves beside the chain's token (a top-k first level, as Medusa's and EAGLE's trees have, at every depth). They
  come from logits the chain computed anyway, so they cost no draft forward, only k more tokens in the verify; with
  the confidence stop the chain ends at a token the drafter was unsure of, so its last siblings sit where a second
  guess is likeliest to be needed. Greedy only, for the same reason as the copied branch: a draft's runners-up are
  not independent draws from q.

A combination is a drafter like any other: it passes ``begin`` and ``observe`` to the drafter inside, and its draft
kind and target features are that drafter's unless it drafts differently itself. :func:`draft_model_drafter` builds
the combination the draft-model options name (``prompt_lookup``, ``prompt_lookup_alone``, ``chain_copy``,
``siblings``, ...).
"""

from __future__ import annotations

import copy
from collections.abc import Hashable
from typing import Protocol

import torch

from specdraft.drafters.base import Draft, Drafter, DrafterFacts, TargetFeatures, draft_kind, facts_of, target_features
from specdraft.drafters.draft_model import COPY, SIBLING, Chain, DraftModelDrafter, Fill
from specdraft.drafters.graph import GraphDrafter
from specdraft.drafters.ngram import NGramDrafter, NGramTable
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.errors import SpecdraftError
from specdraft.models.base import CausalLM, KVCache
from specdraft.sampling import SamplingConfig
from specdraft.trees import chain_parents, insert_path, is_chain
from specdraft.verification import VerifyResult

SINK_TOKENS = 4  # the first tokens a context window keeps (attention sinks)


class ChainDrafter(Drafter, Protocol):
    """A drafter whose chain can be asked for runners-up and have depths filled from elsewhere
    (:meth:`DraftModelDrafter.chain`)."""

    def chain(self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig,
              generator: torch.Generator | None, fill: Fill | None = None, runners_up: int = 0) -> Chain:
        ...


class Combination:
    """What every combination shares: the drafter inside (``inner``), whose name, limits, verbs and capabilities it
    passes on."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.name, self.vocab_size, self.max_context = inner.name, inner.vocab_size, inner.max_context

    def begin(self, target: CausalLM, cache: KVCache) -> None:
        self.inner.begin(target, cache)

    def observe(self, result: VerifyResult) -> None:
        self.inner.observe(result)

    def draft_kind(self, context: torch.Tensor, sampling: SamplingConfig) -> Hashable:
        return draft_kind(self.inner, context, sampling)

    def target_features(self) -> TargetFeatures | None:
        return target_features(self.inner)

    @property
    def facts(self) -> DrafterFacts:
        """The inner drafter's: the parts a combination adds (copies of the context, runners-up) change none."""
        return facts_of(self.inner)


class ChainCombination(Combination):
    """A combination that changes the inner chain (:meth:`chain`, which it defines): its draft is that chain's."""

    def chain(self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig,
              generator: torch.Generator | None, fill: Fill | None = None, runners_up: int = 0) -> Chain:
        raise NotImplementedError

    def propose(self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        return self.chain(context, num_draft_tokens, sampling, generator).draft


class WithPromptLookup(Combination):
    """``inner``'s draft with the copy ``lookup`` finds as a second branch, or the copy alone after a match of at
    least ``alone`` tokens (0: never alone); greedy only (module docstring)."""

    def __init__(self, inner: Drafter, lookup: PromptLookupDrafter, alone: int = 0) -> None:
        if alone < 0:
            raise SpecdraftError(f"prompt_lookup_alone must be >= 0, got {alone}")
        super().__init__(inner)
        self.lookup, self.alone = lookup, alone

    def propose(self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        if not sampling.greedy:
            return self.inner.propose(context, num_draft_tokens, sampling, generator)
        size, copied = self.lookup.match(context, num_draft_tokens)
        if self.alone and size >= self.alone and len(copied) == num_draft_tokens:  # no draft forwards
            return Draft(copied.tokens, source=torch.full((len(copied),), COPY + size))
        draft = self.inner.propose(context, num_draft_tokens, sampling, generator)
        if not len(copied):
            return draft
        parents = draft.parents if draft.parents is not None else chain_parents(len(draft))
        tokens, parents = insert_path(draft.tokens, parents, copied.tokens)
        added = tokens.shape[0] - len(draft)
        confidence = draft.confidence if draft.confidence is not None else torch.full((len(draft),), float("nan"))
        source = draft.source if draft.source is not None else torch.zeros(len(draft), dtype=torch.long)
        confidence = torch.cat([confidence, torch.full((added,), float("nan"))])
        source = torch.cat([source, torch.full((added,), COPY + size)])
        return Draft(tokens, None, None if is_chain(parents) else parents, draft.aux, confidence, source)

    def draft_kind(self, context: torch.Tensor, sampling: SamplingConfig) -> Hashable:
        """("copy", n) where a matched n-gram would be drafted alone; else the inner drafter's kind."""
        if self.alone and sampling.greedy:
            size, copied = self.lookup.match(context, 1)
            if size >= self.alone and len(copied):
                return "copy", size
        return draft_kind(self.inner, context, sampling)


class WithNGramTable(Combination):
    """The n-gram drafter's draft alone where it has a context copy or a table n-gram of at least ``min_order``
    tokens, no draft forward; ``inner``'s draft elsewhere (module docstring)."""

    def __init__(self, inner: Drafter, ngram: NGramDrafter, min_order: int) -> None:
        if min_order < 1:
            raise SpecdraftError(f"ngram_min_order must be >= 1, got {min_order}")
        super().__init__(inner)
        self.ngram, self.min_order = ngram, min_order

    def _alone(self, context: torch.Tensor, sampling: SamplingConfig) -> Hashable:
        if not sampling.greedy:
            return None
        kind = self.ngram.draft_kind(context, sampling)
        return kind if kind and self.ngram.kind_order(kind) >= self.min_order else None

    def propose(self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        if self._alone(context, sampling) is not None:
            return self.ngram.propose(context, num_draft_tokens, sampling, generator)
        return self.inner.propose(context, num_draft_tokens, sampling, generator)

    def draft_kind(self, context: torch.Tensor, sampling: SamplingConfig) -> Hashable:
        """("ngram", kind) where the n-gram drafter drafts alone; else the inner drafter's kind."""
        kind = self._alone(context, sampling)
        return ("ngram", kind) if kind is not None else draft_kind(self.inner, context, sampling)


class WithChainCopies(ChainCombination):
    """``inner``'s chain with the continuation of a matched n-gram (``min_ngram`` or longer) at every depth that has
    one (module docstring)."""

    def __init__(self, inner: ChainDrafter, min_ngram: int) -> None:
        if min_ngram < 1:
            raise SpecdraftError(f"chain_copy must be >= 0 (0 = off), got {min_ngram}")
        super().__init__(inner)
        self.lookup = PromptLookupDrafter(max(min_ngram, 4), min_ngram)

    def _copy(self, running: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        size, copied = self.lookup.match(running, 1)
        return (copied.tokens[0], COPY + size) if size else None

    def chain(self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig,
              generator: torch.Generator | None, fill: Fill | None = None, runners_up: int = 0) -> Chain:
        """``inner``'s chain with this combination's copies (before ``fill``'s tokens)."""
        def copy_or_fill(running: torch.Tensor) -> tuple[torch.Tensor, int] | None:
            found = self._copy(running)
            return found if found is not None or fill is None else fill(running)

        return self.inner.chain(context, num_draft_tokens, sampling, generator, copy_or_fill, runners_up)

    def draft_kind(self, context: torch.Tensor, sampling: SamplingConfig) -> Hashable:
        """("chain_copy", n) where the chain would start with a copy after a matched n-gram; else the inner kind."""
        size = self.lookup.match(context, 1)[0]
        return ("chain_copy", size) if size else draft_kind(self.inner, context, sampling)


class WithContextWindow(ChainCombination):
    """``inner``'s chain drafted from what a window of ``window`` tokens keeps of the context (module docstring);
    ``fill`` still reads the whole context."""

    def __init__(self, inner: ChainDrafter, window: int) -> None:
        if window <= SINK_TOKENS:
            raise SpecdraftError(f"context_window must be 0 (the whole context) or above {SINK_TOKENS}, got {window}")
        super().__init__(inner)
        self.window = window
        self._start: int | None = None  # where this sequence's window begins in its context

    def begin(self, target: CausalLM, cache: KVCache) -> None:
        self._start = None
        super().begin(target, cache)

    def view(self, context: torch.Tensor) -> torch.Tensor:
        """What the model reads of ``context`` (N,): its first :data:`SINK_TOKENS` tokens and everything from where
        the window began when the sequence's prompt was read (all of a short one). (M,), M <= N."""
        if self._start is None:
            self._start = max(SINK_TOKENS, context.shape[0] - (self.window - SINK_TOKENS))
        if self._start <= SINK_TOKENS:
            return context
        return torch.cat([context[:SINK_TOKENS], context[self._start:]])

    def chain(self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig,
              generator: torch.Generator | None, fill: Fill | None = None, runners_up: int = 0) -> Chain:
        view = self.view(context)

        def whole(running: torch.Tensor) -> tuple[torch.Tensor, int] | None:  # the drafted tokens after the context
            return fill(torch.cat([context, running[view.shape[0]:]]))

        return self.inner.chain(view, num_draft_tokens, sampling, generator, whole if fill else None, runners_up)


class WithSiblings(Combination):
    """``inner``'s chain with its ``siblings`` runners-up as leaves beside every token (greedy; module docstring)."""

    def __init__(self, inner: ChainDrafter, siblings: int) -> None:
        if siblings < 1:
            raise SpecdraftError(f"siblings must be >= 0 (0 = off), got {siblings}")
        super().__init__(inner)
        self.siblings = siblings

    def chain(self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig,
              generator: torch.Generator | None, fill: Fill | None = None, runners_up: int = 0) -> Chain:
        return self.inner.chain(context, num_draft_tokens, sampling, generator, fill, runners_up)

    def propose(self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        if not sampling.greedy:
            return self.inner.propose(context, num_draft_tokens, sampling, generator)
        chain = self.inner.chain(context, num_draft_tokens, sampling, generator, runners_up=self.siblings)
        draft = chain.draft
        tokens, parents = draft.tokens, chain_parents(len(draft))  # greedy: q is None
        confidence, source = draft.confidence, draft.source
        for depth, (siblings, probs) in enumerate(chain.runners_up):  # leaves beside chain[depth], never equal to it
            tokens = torch.cat([tokens, siblings])
            parents = torch.cat([parents, torch.full((len(siblings),), depth - 1, dtype=torch.long)])
            confidence, source = torch.cat([confidence, probs]), torch.cat([source, torch.full_like(siblings, SIBLING)])
        return Draft(tokens, None, None if is_chain(parents) else parents, None, confidence, source)


# draft_model_drafter's options that shape a chain and are refused in tree mode (tree_branching > 0)
CHAIN_OPTIONS = ("confidence_threshold", "prompt_lookup", "prompt_lookup_min", "prompt_lookup_alone", "siblings",
                 "chain_copy", "context_window", "ngram_table", "ngram_min_order")


def draft_model_drafter(model: CausalLM, name: str | None = None, tree_branching: int = 0, tree_nodes: int = 16,
                        confidence_threshold: float = 0.0, prompt_lookup: int = 0, prompt_lookup_min: int = 1,
                        prompt_lookup_alone: int = 0, siblings: int = 0, chain_copy: int = 0, merge_ngram: int = 0,
                        context_window: int = 0, ngram_min_order: int = 2, *, keep: torch.Tensor | None = None,
                        ngram: NGramTable | None = None) -> Drafter:
    """The drafter the draft-model options name: a :class:`DraftModelDrafter` (``tree_branching``, ``tree_nodes``,
    ``confidence_threshold``, ``keep``; with ``merge_ngram`` = n > 0 its tree grown as a graph whose nodes with
    equal last n tokens merge, :class:`~specdraft.drafters.graph.GraphDrafter`), inside :class:`WithContextWindow`
    (``context_window`` = W > 0), then :class:`WithChainCopies` (``chain_copy`` = m > 0), then
    :class:`WithSiblings` (``siblings`` = k > 0), then :class:`WithPromptLookup` (``prompt_lookup`` = n > 0, down to
    ``prompt_lookup_min``, alone from ``prompt_lookup_alone`` tokens), then :class:`WithNGramTable` (``ngram``, a
    table :func:`~specdraft.drafters.ngram.load_table` read, alone from ``ngram_min_order`` tokens). The
    combinations apply to chains only."""
    if prompt_lookup < 0:
        raise SpecdraftError(f"prompt_lookup must be >= 0 (0 = off), got {prompt_lookup}")
    if prompt_lookup and tree_branching:
        raise SpecdraftError("prompt_lookup applies to chain drafts, not to tree mode (tree_branching)")
    if prompt_lookup_alone and not prompt_lookup:
        raise SpecdraftError(f"prompt_lookup_alone must be >= 0 and needs prompt_lookup, got {prompt_lookup_alone}")
    for option, value in (("siblings", siblings), ("chain_copy", chain_copy)):
        if value < 0 or (value and tree_branching):
            raise SpecdraftError(f"{option} must be >= 0 (0 = off) and applies to chain drafts, got {value}"
                                 + (" with tree_branching" if tree_branching else ""))
    if context_window < 0 or (context_window and tree_branching):
        raise SpecdraftError(f"context_window must be >= 0 (0 = the whole context) and applies to chain drafts, got "
                             f"{context_window}" + (" with tree_branching" if tree_branching else ""))
    if merge_ngram < 0 or (merge_ngram and (not tree_branching or confidence_threshold)):
        raise SpecdraftError(f"merge_ngram must be >= 0 (0 = off) and applies to tree drafts (tree_branching, no "
                             f"confidence_threshold), got {merge_ngram}")
    drafter: Drafter
    if merge_ngram:
        drafter = GraphDrafter(model, name, tree_branching, tree_nodes, merge_ngram, keep=keep)
    else:
        drafter = DraftModelDrafter(model, name, tree_branching, tree_nodes, confidence_threshold, keep=keep)
    if context_window:
        drafter = WithContextWindow(drafter, context_window)
    if chain_copy:
        drafter = WithChainCopies(drafter, chain_copy)
    if siblings:
        drafter = WithSiblings(drafter, siblings)
    if prompt_lookup:
        drafter = WithPromptLookup(drafter, PromptLookupDrafter(prompt_lookup, prompt_lookup_min), prompt_lookup_alone)
    if ngram is not None:
        drafter = WithNGramTable(drafter, NGramDrafter(ngram), ngram_min_order)
    return drafter


def draft_model_of(drafter: Drafter | None) -> DraftModelDrafter | None:
    """The :class:`DraftModelDrafter` inside ``drafter`` (itself, or the innermost drafter of a combination), if any."""
    while isinstance(drafter, Combination):
        drafter = drafter.inner
    return drafter if isinstance(drafter, DraftModelDrafter) else None


def with_model(drafter: Drafter, model: CausalLM) -> Drafter:
    """A copy of ``drafter`` whose draft model is ``model`` (every combination layer copied, so ``drafter`` is left as
    it was)."""
    if isinstance(drafter, Combination):
        outer = copy.copy(drafter)
        outer.inner = with_model(drafter.inner, model)
        return outer
    if not isinstance(drafter, DraftModelDrafter):
        raise SpecdraftError(f"{drafter.name} drafts with no draft model")
    inner = copy.copy(drafter)
    inner.model = model
    return inner
