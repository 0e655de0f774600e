"""An independent draft model (Leviathan et al. 2023; Chen et al. 2023): a small causal LM sharing the target's
tokenizer drafts γ tokens autoregressively on its own KV cache and returns its distributions q.

Tree mode (``tree_branching`` > 0): a dynamic token tree in the spirit of EAGLE-2 (Li et al. 2024) and SpecInfer
(Miao et al. 2024). At each depth every frontier node gets ``tree_branching`` children: its top-k tokens when
greedy (deterministic, q None), or k independent draws from its warped q when sampling (SpecInfer's multi-draft
rule keeps that lossless). The ``tree_branching`` children with the highest cumulative draft log-probability
(EAGLE-2's confidence) become the next frontier, expanded in one draft forward with a tree mask; finally the
``tree_nodes`` most confident nodes are kept. Depth = num_draft_tokens, so one tree costs as many draft forwards
as a chain.

Early stopping (``confidence_threshold`` > 0, chain mode): drafting stops after the first token whose draft
probability q(token) is below the threshold, as transformers' assisted generation does with
``assistant_confidence_threshold`` (a static form of the adaptive draft lengths of SpecDec++, Huang et al. 2024,
arXiv 2405.19715). The draft length then depends only on the drafter's own distributions and draws, so the output
distribution is unchanged; a weak drafter stops paying for tokens the target will likely reject.

Filled depths (:meth:`DraftModelDrafter.chain`'s ``fill``): a drafter combined with this one may supply the token
of any depth of the chain itself (:class:`~specdraft.drafters.combined.WithChainCopies` copies the continuation of a
matched n-gram). Such a token needs no draft forward: the model catches up over the filled tokens in one forward
when it next drafts, so its cache stays synchronised by longest common prefix. When sampling, a filled
token's q row is a point mass on it. The chain also returns, when asked, the runners-up of each depth the model
drafted (:class:`~specdraft.drafters.combined.WithSiblings` hangs them beside the chain); they come from logits the
chain computed anyway. Prompt lookup beside the chain is :class:`~specdraft.drafters.combined.WithPromptLookup`.

Draft vocabulary (``keep``, the ``draft_vocab=N`` option of :func:`specdraft.drafters.registry.load_drafter`): the
drafter only proposes the N tokens most frequent in its distillation data (FR-Spec, :mod:`specdraft.draft_vocab`). A
native drafter then multiplies by N rows of its LM head instead of all V (most of a small drafter's step); other models
compute full logits and are masked (same drafts, no saving).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from specdraft.draft_vocab import DraftVocab
from specdraft.drafters.base import CatchUp, Draft, DrafterFacts, common_prefix, confident_tree, grown_cache
from specdraft.errors import SpecdraftError
from specdraft.models.base import CausalLM, KVCache
from specdraft.sampling import SamplingConfig, argmax, check_finite, sample, warp
from specdraft.trees import add_children, expansion_mask
from specdraft.verification import VerifyResult

MODEL, SIBLING, COPY = 0, 1, 10  # Draft.source of the model's chain, its siblings, and a copy (+ n-gram size)

Fill = Callable[[torch.Tensor], "tuple[torch.Tensor, int] | None"]  # running context -> (token, source) or None


@dataclass(frozen=True)
class Chain:
    """A drafted chain and, when asked for, the runners-up of each depth: (tokens (k,), draft probabilities (k,))
    per depth, empty at a filled depth."""

    draft: Draft
    runners_up: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class DraftModelDrafter:
    """Draft with a small model: a chain (cut after a token below ``confidence_threshold``) or, with
    ``tree_branching`` > 0, a dynamic tree of at most ``tree_nodes`` nodes; ``keep``: a draft vocabulary (module
    docstring). Its cache is synchronised to the context by longest common prefix, so rejected draft tokens are
    rolled back by a crop and the tokens the target added are fed in one forward."""

    facts = DrafterFacts(replayable=True)  # with any of its options; chosen by its folder (--draft), not by name

    def __init__(self, model: CausalLM, name: str | None = None, tree_branching: int = 0, tree_nodes: int = 16,
                 confidence_threshold: float = 0.0, *, keep: torch.Tensor | None = None) -> None:
        if tree_branching < 0 or tree_nodes < 1:
            raise SpecdraftError(f"tree_branching must be >= 0 and tree_nodes >= 1, got {tree_branching}, {tree_nodes}")
        if not 0.0 <= confidence_threshold < 1.0:
            raise SpecdraftError(f"confidence_threshold must be in [0, 1), got {confidence_threshold}")
        if confidence_threshold and tree_branching:
            raise SpecdraftError("confidence_threshold applies to chain drafts; tree mode ranks nodes by confidence "
                                 "already (tree_nodes)")
        self.confidence_threshold = float(confidence_threshold)
        self.model = model
        weight = getattr(model, "lm_head_weight", None)
        self._keep = keep
        # the subset in id order: an argmax over its logits is the argmax over the whole vocabulary's (-inf outside)
        ordered = None if keep is None else keep.to(torch.long).sort().values
        self._vocab = DraftVocab(weight if weight is not None else torch.empty(model.vocab_size, 0), ordered)
        self._rows = self._vocab.weight if self._vocab.keep is not None and weight is not None else None  # (N, D)
        prepare = getattr(model, "prepare_logits_weight", None)
        if self._rows is not None and prepare is not None:
            prepare(self._rows)  # blocks of the vocabulary's head rows made at load, not in the first draft
        self.tree_branching, self.tree_nodes = tree_branching, tree_nodes
        self.name = name or f"draft:{model.name}"
        self.vocab_size = model.vocab_size
        self.max_context = model.max_context
        self._cache: KVCache | None = None
        self._cached = torch.empty(0, dtype=torch.long)  # (L,) ids whose keys/values are in the cache
        self.last_catch_up: CatchUp | None = None  # the first forward of the last chain (drafters.base.catch_up)
        self._new_sequence = True  # no forward since ``begin``: the next one reads the sequence's prompt

    @property
    def vocab_keep(self) -> torch.Tensor | None:
        """(N,) the token ids of the draft vocabulary, or None when the drafter drafts from the full vocabulary."""
        return None if self._vocab.keep is None else self._keep

    def _sync(self, context: torch.Tensor, num_draft_tokens: int) -> torch.Tensor:
        """Bring the cache to ``context[:-1]`` or further and return logits predicting the next token. (V,)"""
        logits = self._forward(self._crop(context, num_draft_tokens).unsqueeze(0), logits_to_keep=1)[0, -1]  # (V,)
        self._cached = context
        return logits

    def _crop(self, context: torch.Tensor, num_draft_tokens: int) -> torch.Tensor:
        """Crop the cache to the longest prefix it shares with ``context[:-1]`` (a new, larger cache when
        ``context`` and the draft would not fit) and return the tail of ``context`` it lacks, (T,), T >= 1."""
        grown = grown_cache(self._cache, context.shape[0] + num_draft_tokens, self.model.new_cache,
                            self.model.max_context)
        if grown is not None:
            self._cache, self._cached = grown, self._cached[:0]
        keep = common_prefix(self._cached, context[:-1])
        self._cache.crop(keep)
        self._cached = context[:keep]
        return context[keep:]

    @torch.inference_mode()
    def propose(
        self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Draft:
        if self.tree_branching:
            return self._propose_tree(context, num_draft_tokens, sampling, generator)
        return self.chain(context, num_draft_tokens, sampling, generator).draft

    def draft_kind(self, context: torch.Tensor, sampling: SamplingConfig) -> Hashable:
        """"model": every step drafts the model's chain or tree."""
        return "model"

    @torch.inference_mode()
    def chain(self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig,
              generator: torch.Generator | None, fill: Fill | None = None, runners_up: int = 0) -> Chain:
        """The model's chain of up to ``num_draft_tokens`` tokens after ``context`` (fewer after a confidence stop),
        with each token's confidence. A depth whose running context ``fill`` answers takes the token it gives (no
        draft forward, confidence NaN, the source it gives); the model is fed only when a depth needs its logits, so
        a chain of filled tokens costs no draft forward. Greedy with ``runners_up`` = k: the k next most likely draft
        tokens at every depth the model drafted."""
        if self.tree_branching:
            raise SpecdraftError("a draft model in tree mode (tree_branching) drafts trees, not chains")
        pending = list(self._crop(context, num_draft_tokens))  # uncached tokens, fed when the model next drafts
        # a new sequence: its prompt is read now, whole or past a prefix the last sequence shared (a chat template's)
        fresh, first = self._new_sequence or len(pending) == context.shape[0], True
        tokens, probs, confidence, source, alternatives = [], [], [], [], []
        running = context  # (N + i,) the context and the tokens drafted so far, for ``fill``
        for i in range(num_draft_tokens):
            filled = fill(running) if fill is not None else None
            if filled is not None:  # a token from elsewhere: no draft forward
                token, kind = filled
                if not sampling.greedy:
                    probs.append(torch.zeros(self.vocab_size).index_fill_(0, token.view(1), 1.0))  # point mass
                confidence.append(torch.tensor(float("nan")))
                if runners_up:
                    alternatives.append((torch.empty(0, dtype=torch.long), torch.empty(0)))
            else:  # the model catches up over the uncached and filled tokens in one forward
                ids, pending, kind = torch.stack(pending).view(1, -1), [], MODEL
                started = time.perf_counter()
                if sampling.greedy and not runners_up:  # the draft vocabulary's logits alone suffice
                    token = self._greedy(self._subset_logits(ids, logits_to_keep=1)[0, -1], confidence)
                else:
                    logits = self._forward(ids, logits_to_keep=1)[0, -1]  # (V,)
                    token = self._pick(logits, sampling, generator, (probs, confidence, alternatives), runners_up)
                if first:  # the forward that read what the drafter had not seen (speculation prices it apart)
                    self.last_catch_up = CatchUp(started, time.perf_counter() - started, fresh, ids.shape[1])
                    first = False
                    self._new_sequence = False
            tokens.append(token)
            source.append(kind)
            if filled is None and self.confidence_threshold and self._unsure(token, probs, confidence, sampling):
                break
            if i + 1 < num_draft_tokens:  # the last draft token is fed next step, only if accepted
                pending.append(token)
                if fill is not None:
                    running = torch.cat([running, token.view(1)])
        return self._chain(context, tokens, probs, confidence, source, pending, alternatives)

    def _pick(self, logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None,
              out: tuple[list, list, list], runners_up: int) -> torch.Tensor:
        """The model's token from ``logits`` (V,): the argmax, or a draw from warped q. Appends to ``out`` = (q rows,
        confidences, runners-up) what the token brings."""
        probs, confidence, alternatives = out
        if sampling.greedy:
            token = argmax(logits)
            soft = torch.softmax(logits.float(), -1)  # (V,)
            confidence.append(soft[token])
            if runners_up:
                others = self._runners_up(logits, token, runners_up)
                alternatives.append((others, soft[others]))
            return token
        probs.append(warp(logits, sampling))  # (V,)
        confidence.append(probs[-1].max())  # read before the draw: a stopping time (speculation module)
        return sample(probs[-1], generator)

    def _chain(self, context: torch.Tensor, tokens: list, probs: list, confidence: list, source: list[int],
               pending: list, alternatives: list) -> Chain:
        """The drafted chain; the cache now holds everything fed, the context and the drafted tokens but the last
        and the ``pending`` ones."""
        draft = torch.stack(tokens) if tokens else torch.empty(0, dtype=torch.long)  # (γ,)
        drafted = torch.cat([context, draft[:-1]])
        self._cached = drafted[: drafted.shape[0] - len(pending)]
        sure = torch.stack(confidence).float() if confidence else torch.empty(0)  # (γ,)
        kinds = torch.tensor(source, dtype=torch.long)  # (γ,) MODEL, or the source ``fill`` gave
        return Chain(Draft(draft, torch.stack(probs) if probs else None, confidence=sure, source=kinds), alternatives)

    def _runners_up(self, logits: torch.Tensor, token: torch.Tensor, count: int) -> torch.Tensor:
        """The ``count`` most likely tokens after ``token`` (the argmax of ``logits`` (V,)), finite logits only (a
        draft vocabulary leaves -inf elsewhere). (k,) long, k <= count."""
        top = logits.topk(count + 1)
        keep = (top.indices != token) & top.values.isfinite()  # (k + 1,)
        return top.indices[keep][:count]

    def _forward(self, ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """Draft logits (1, T, V) float32 of ``ids`` (1, T) on the draft cache, checked finite; -inf outside a draft
        vocabulary."""
        if self._vocab.keep is None:
            logits = self.model.forward(ids, self._cache, **kwargs)  # (1, T, V)
            check_finite(logits, "draft")
            return logits
        if self._rows is not None:  # native: only the kept rows of the LM head
            return self._vocab.expand(self.model.forward(ids, self._cache, logits_weight=self._rows, **kwargs))
        return self._vocab.expand(self.model.forward(ids, self._cache, **kwargs)[..., self._vocab.keep])

    def _unsure(self, token: torch.Tensor, probs: list[torch.Tensor], confidence: list[torch.Tensor],
                sampling: SamplingConfig) -> bool:
        """Whether q(token) is below ``confidence_threshold`` (greedy: q = softmax of the raw logits, the token's
        confidence; sampling: the warped q it was drawn from)."""
        q = confidence[-1] if sampling.greedy else probs[-1][token]
        return float(q) < self.confidence_threshold

    def _subset_logits(self, ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """Draft logits over the draft vocabulary in id order, (1, T, N) float32 (the whole V without one), checked
        finite."""
        if self._rows is not None:  # native: only the kept rows of the LM head
            logits = self.model.forward(ids, self._cache, logits_weight=self._rows, **kwargs).float()
        elif self._vocab.keep is not None:
            logits = self.model.forward(ids, self._cache, **kwargs)[..., self._vocab.keep].float()
        else:
            logits = self.model.forward(ids, self._cache, **kwargs).float()
        check_finite(logits, "draft")
        return logits

    def _greedy(self, logits: torch.Tensor, confidence: list) -> torch.Tensor:
        """The argmax token of the draft vocabulary's ``logits`` (N,) (the lowest id among ties, as over the whole
        vocabulary), appending its softmax probability to ``confidence``."""
        index = argmax(logits)
        confidence.append(torch.softmax(logits, -1)[index])
        return index if self._vocab.keep is None else self._vocab.keep[index]

    def _propose_tree(
        self, context: torch.Tensor, depth: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Draft:
        """A dynamic tree of at most ``tree_nodes`` nodes and ``depth`` levels (see the module docstring)."""
        frontier = [(-1, self._sync(context, depth * self.tree_branching))]  # (node, logits (V,)) to expand
        base = self._cache.length  # the draft cache holds the whole context; tree nodes are fed after it
        tokens, parents, q_rows, scores, slot_of = [], [], [], [], {}
        for level in range(depth):
            children = []
            for node, logits in frontier:
                probs = torch.softmax(logits.float(), -1) if sampling.greedy else warp(logits, sampling)  # (V,)
                children += add_children(node, probs, self.tree_branching, sampling.greedy, generator,
                                         (tokens, parents, q_rows, scores))
            if level + 1 == depth:
                break
            chosen = sorted(children, key=lambda n: -scores[n])[: self.tree_branching]
            frontier = list(zip(chosen, self._expand(chosen, tokens, parents, slot_of, base, level + 1), strict=True))
        self._cache.crop(base)
        self._cached = context
        return self._best_nodes(tokens, parents, q_rows, scores, sampling.greedy)

    def _expand(self, nodes: list[int], tokens: list[int], parents: list[int], slot_of: dict[int, int], base: int,
                depth: int) -> torch.Tensor:
        """One draft forward over ``nodes`` (all at ``depth``), each attending the context and its ancestors.
        Returns their logits, (F, V)."""
        start = self._cache.length
        mask = expansion_mask(nodes, parents, slot_of, base, start)  # (F, S)
        positions = torch.full((len(nodes),), base - 1 + depth, dtype=torch.long)  # (F,)
        ids = torch.tensor([tokens[n] for n in nodes]).unsqueeze(0)  # (1, F)
        return self._forward(ids, positions=positions, attention_mask=mask)[0]  # (F, V)

    def _best_nodes(self, tokens, parents, q_rows, scores, greedy: bool) -> Draft:
        """The ``tree_nodes`` most confident nodes, closed under ancestors, in node order."""
        return confident_tree(tokens, parents, scores, self.tree_nodes, None if greedy else torch.stack(q_rows))

    def begin(self, target, cache) -> None:
        self._new_sequence = True

    def observe(self, result: VerifyResult) -> None:
        pass
