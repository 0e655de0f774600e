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

Prompt-lookup branch (``prompt_lookup`` = n > 0, chain mode): the context's last n-gram (n down to
``prompt_lookup_min``) is looked up in the context, as :class:`~specdraft.drafters.prompt_lookup.PromptLookupDrafter`
does (LLMA, Yang et al. 2023; Saxena 2023). Greedy: the copied continuation is verified beside the model's chain in
the same target forward, as a second branch of a token tree (:func:`specdraft.trees.insert_path`), so a step keeps
the longer of the two accepted prefixes; a model drafting chat and a copy of the article in a summary or a
retrieved passage each cover what the other misses. With ``prompt_lookup_alone`` = m > 0, a match of at least m
tokens that yields a full γ-token copy is drafted alone and the model's draft forwards are skipped that step (the
choice depends on the context only). Greedy only: when sampling, siblings must be independent draws
from one distribution (SpecInfer) and a copied branch is not, so the option is ignored there.

Copies inside the chain (``chain_copy`` = m > 0, chain mode): at every depth, where the context so far (with the
tokens already drafted) ends in an n-gram seen earlier in it, n from max(m, 4) down to m, the token that followed
its most recent occurrence is drafted instead of the model's, as retrieval and a small model take turns in
SAM-Decoding (Hu et al. 2024, arXiv 2411.10666); elsewhere the model drafts. A copied token needs no draft forward
(the model catches up in one forward over the copied tokens when it drafts again). On SmolLM2's greedy answers to
Spec-Bench questions, teacher-forced, a copy after a match of two or more tokens was right more often than the
two-layer drafter's argmax, and a copy after a single token less often (docs/onpolicy.md), so m = 2 is the setting
to start from. Whether a depth copies depends only on the context and the tokens drawn before it, so the draft
length and q stay a stopping time of the drafting process: greedy, the copy is a deterministic token; sampling, its
q row is a point mass on it (accepted with probability p(token), the rest resampled from the residual), which is
lossless under speculative sampling's rule.

Siblings (``siblings`` = k > 0, chain mode, greedy): at every depth the chain reaches, the k next most likely
draft tokens join the tree as leaves beside the chain's token (a top-k first level, as Medusa's and EAGLE's trees
have, at every depth). They come from logits the chain computed anyway, so they cost no draft forward, only k more
tokens in the verify; with the confidence stop the chain ends at a token the drafter was unsure of, so its last
siblings sit where a second guess is likeliest to be needed. Greedy only, for the same reason as the copy: a
draft's runners-up are not independent draws from q.

Draft vocabulary (``keep``, the ``draft_vocab=N`` option of :func:`specdraft.drafters.loading.load_drafter`): the
drafter only proposes the N tokens most frequent in its distillation data (FR-Spec, :mod:`specdraft.draft_vocab`). A
native drafter then multiplies by N rows of its LM head instead of all V (most of a small drafter's step); other models
compute full logits and are masked (same drafts, no saving).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from specdraft.draft_vocab import DraftVocab
from specdraft.drafters.base import EMPTY_DRAFT, Draft
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.errors import SpecdraftError
from specdraft.models.base import CausalLM, KVCache
from specdraft.sampling import SamplingConfig, check_finite, sample, warp
from specdraft.trees import add_children, chain_parents, expansion_mask, insert_path, is_chain, most_confident
from specdraft.verification import VerifyResult

MODEL, SIBLING, COPY = 0, 1, 10  # Draft.source of the model's chain, its siblings, and a copy (+ n-gram size)


def _with_source(draft: Draft, source: int) -> Draft:
    return Draft(draft.tokens, draft.q, draft.parents, draft.aux, None, torch.full((len(draft),), source))


class DraftModelDrafter:
    """Draft with a small model. Its cache is synchronised to the context by longest common prefix, so rejected
    draft tokens are rolled back by a crop and the tokens the target added are fed in one forward."""

    def __init__(self, model: CausalLM, name: str | None = None, tree_branching: int = 0, tree_nodes: int = 16,
                 confidence_threshold: float = 0.0, prompt_lookup: int = 0, prompt_lookup_min: int = 1,
                 prompt_lookup_alone: int = 0, siblings: int = 0, chain_copy: int = 0, *,
                 keep: torch.Tensor | None = None) -> None:
        if tree_branching < 0 or tree_nodes < 1:
            raise SpecdraftError(f"tree_branching must be >= 0 and tree_nodes >= 1, got {tree_branching}, {tree_nodes}")
        if not 0.0 <= confidence_threshold < 1.0:
            raise SpecdraftError(f"confidence_threshold must be in [0, 1), got {confidence_threshold}")
        if confidence_threshold and tree_branching:
            raise SpecdraftError("confidence_threshold applies to chain drafts; tree mode ranks nodes by confidence "
                                 "already (tree_nodes)")
        if prompt_lookup and tree_branching:
            raise SpecdraftError("prompt_lookup applies to chain drafts, not to tree mode (tree_branching)")
        self.confidence_threshold = float(confidence_threshold)
        if prompt_lookup < 0:
            raise SpecdraftError(f"prompt_lookup must be >= 0 (0 = off), got {prompt_lookup}")
        if prompt_lookup_alone < 0 or (prompt_lookup_alone and not prompt_lookup):
            raise SpecdraftError(f"prompt_lookup_alone must be >= 0 and needs prompt_lookup, got {prompt_lookup_alone}")
        if siblings < 0 or (siblings and tree_branching):
            raise SpecdraftError(f"siblings must be >= 0 (0 = off) and applies to chain drafts, got {siblings}"
                                 + (" with tree_branching" if tree_branching else ""))
        self.siblings = int(siblings)
        if chain_copy < 0 or (chain_copy and tree_branching):
            raise SpecdraftError(f"chain_copy must be >= 0 (0 = off) and applies to chain drafts, got {chain_copy}"
                                 + (" with tree_branching" if tree_branching else ""))
        self._chain_copy = PromptLookupDrafter(max(chain_copy, 4), chain_copy) if chain_copy > 0 else None
        self._lookup = PromptLookupDrafter(prompt_lookup, prompt_lookup_min) if prompt_lookup > 0 else None
        self.prompt_lookup_alone = prompt_lookup_alone
        self.model = model
        weight = getattr(model, "lm_head_weight", None)
        self._vocab = DraftVocab(weight if weight is not None else torch.empty(model.vocab_size, 0), keep)
        self._rows = self._vocab.weight if self._vocab.keep is not None and weight is not None else None  # (N, D)
        self.tree_branching, self.tree_nodes = tree_branching, tree_nodes
        self.name = name or f"draft:{model.name}"
        self.vocab_size = model.vocab_size
        self.max_context = model.max_context
        self._cache: KVCache | None = None
        self._cached = torch.empty(0, dtype=torch.long)  # (L,) ids whose keys/values are in the cache

    @property
    def vocab_keep(self) -> torch.Tensor | None:
        """(N,) the token ids of the draft vocabulary, or None when the drafter drafts from the full vocabulary."""
        return self._vocab.keep

    def _sync(self, context: torch.Tensor, num_draft_tokens: int) -> torch.Tensor:
        """Bring the cache to ``context[:-1]`` or further and return logits predicting the next token. (V,)"""
        logits = self._forward(self._crop(context, num_draft_tokens).unsqueeze(0), logits_to_keep=1)[0, -1]  # (V,)
        self._cached = context
        return logits

    def _crop(self, context: torch.Tensor, num_draft_tokens: int) -> torch.Tensor:
        """Crop the cache to the longest prefix it shares with ``context[:-1]`` (a new, larger cache when
        ``context`` and the draft would not fit) and return the tail of ``context`` it lacks, (T,), T >= 1."""
        needed = context.shape[0] + num_draft_tokens
        if self._cache is None or self._cache.capacity < needed:
            self._cache = self.model.new_cache(min(max(2 * needed, 256), self.model.max_context))
            self._cached = self._cached[:0]
        shared = min(self._cached.shape[0], context.shape[0] - 1)
        mismatch = (self._cached[:shared] != context[:shared]).nonzero()
        keep = int(mismatch[0]) if mismatch.numel() else shared
        self._cache.crop(keep)
        self._cached = context[:keep]
        return context[keep:]

    @torch.inference_mode()
    def propose(
        self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Draft:
        if self.tree_branching:
            return self._propose_tree(context, num_draft_tokens, sampling, generator)
        if not sampling.greedy:  # the greedy-only branches (copy, siblings) are off: see the module docstring
            return self._propose_chain(context, num_draft_tokens, sampling, generator)[0]
        copied, size = EMPTY_DRAFT, 0
        if self._lookup is not None:
            size, copied = self._lookup.match(context, num_draft_tokens)
            if self.prompt_lookup_alone and size >= self.prompt_lookup_alone and len(copied) == num_draft_tokens:
                return _with_source(copied, COPY + size)  # a long match: the copy alone, no draft forwards
        chain, alternatives = self._propose_chain(context, num_draft_tokens, sampling, generator)
        tokens, parents = chain.tokens, chain_parents(len(chain))  # greedy: q is None
        confidence, source = chain.confidence, chain.source
        for depth, (siblings, probs) in enumerate(alternatives):  # leaves beside chain[depth], never equal to it
            tokens = torch.cat([tokens, siblings])
            parents = torch.cat([parents, torch.full((len(siblings),), depth - 1, dtype=torch.long)])
            confidence, source = torch.cat([confidence, probs]), torch.cat([source, torch.full_like(siblings, SIBLING)])
        if len(copied):
            tokens, parents = insert_path(tokens, parents, copied.tokens)
            added = tokens.shape[0] - confidence.shape[0]
            confidence = torch.cat([confidence, torch.full((added,), float("nan"))])
            source = torch.cat([source, torch.full((added,), COPY + size)])
        return Draft(tokens, None, None if is_chain(parents) else parents, None, confidence, source)

    def draft_kind(self, context: torch.Tensor, sampling: SamplingConfig) -> Hashable:
        """("copy", n) where :meth:`propose` would draft the continuation of a matched n-gram alone (no draft
        forwards); ("chain_copy", n) where its chain starts with a copied token (``chain_copy``); else "model" (its
        chain, with a shorter copy beside it when there is one)."""
        if self.tree_branching:
            return "model"
        if self._lookup is not None and self.prompt_lookup_alone and sampling.greedy:
            size, copied = self._lookup.match(context, 1)
            if size >= self.prompt_lookup_alone and len(copied):
                return "copy", size
        if self._chain_copy is not None:
            size = self._chain_copy.match(context, 1)[0]
            if size:
                return "chain_copy", size
        return "model"

    def _propose_chain(
        self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> tuple[Draft, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The model's chain of up to ``num_draft_tokens`` tokens (fewer after a confidence stop; with ``chain_copy``,
        copied tokens at the depths with a match), with each token's confidence; when greedy with ``siblings`` = k,
        the k next most likely draft tokens at each of its depths and their draft probabilities ((k,), (k,) each,
        empty at copied depths; [] otherwise)."""
        if self._chain_copy is None:
            logits, pending = self._sync(context, num_draft_tokens), []
        else:  # the model is fed only when a depth needs its logits: a chain of copies costs no draft forward
            logits, pending = None, list(self._crop(context, num_draft_tokens))
        tokens, probs, alternatives, confidence, source = [], [], [], [], []
        running = context
        for i in range(num_draft_tokens):
            size, copied = self._chain_copy.match(running, 1) if self._chain_copy is not None else (0, EMPTY_DRAFT)
            if size:  # the continuation of a matched n-gram: no draft forward
                token = copied.tokens[0]
                if not sampling.greedy:
                    probs.append(torch.zeros(self.vocab_size).index_fill_(0, token.view(1), 1.0))  # point mass
                confidence.append(torch.tensor(float("nan")))
                source.append(COPY + size)
                if self.siblings:
                    alternatives.append((torch.empty(0, dtype=torch.long), torch.empty(0)))
            else:
                if pending:  # the model catches up over the context's tail and the copied tokens in one forward
                    logits = self._forward(torch.stack(pending).view(1, -1), logits_to_keep=1)[0, -1]  # (V,)
                    pending = []
                if sampling.greedy:
                    token = logits.argmax(-1)
                    soft = torch.softmax(logits.float(), -1)  # (V,)
                    confidence.append(soft[token])
                    if self.siblings:
                        runners_up = self._runners_up(logits, token)
                        alternatives.append((runners_up, soft[runners_up]))
                else:
                    probs.append(warp(logits, sampling))  # (V,)
                    confidence.append(probs[-1].max())  # read before the draw: a stopping time (speculation module)
                    token = sample(probs[-1], generator)
                source.append(MODEL)
            tokens.append(token)
            if not size and self.confidence_threshold and self._unsure(logits, token, probs, sampling):
                break
            if i + 1 < num_draft_tokens:  # the last draft token is fed next step, only if accepted
                if self._chain_copy is None:
                    logits = self._forward(token.view(1, 1))[0, -1]  # (V,)
                else:  # fed when the model next drafts
                    pending.append(token)
                    running = torch.cat([running, token.view(1)])
        draft = torch.stack(tokens) if tokens else torch.empty(0, dtype=torch.long)  # (γ,)
        drafted = torch.cat([context, draft[:-1]])  # what the model has been fed, but for the pending tail
        self._cached = drafted[: drafted.shape[0] - len(pending)]
        sure = torch.stack(confidence).float() if confidence else torch.empty(0)  # (γ,)
        kinds = torch.tensor(source, dtype=torch.long)  # (γ,) MODEL or COPY + n
        return Draft(draft, torch.stack(probs) if probs else None, confidence=sure, source=kinds), alternatives

    def _runners_up(self, logits: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """The ``siblings`` most likely tokens after ``token`` (the argmax of ``logits`` (V,)), finite logits only
        (a draft vocabulary leaves -inf elsewhere). (k,) long, k <= siblings."""
        top = logits.topk(self.siblings + 1)
        keep = (top.indices != token) & top.values.isfinite()  # (k + 1,)
        return top.indices[keep][: self.siblings]

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

    def _unsure(self, logits: torch.Tensor, token: torch.Tensor, probs: list[torch.Tensor],
                sampling: SamplingConfig) -> bool:
        """Whether q(token) is below ``confidence_threshold`` (greedy: q = softmax of the raw logits)."""
        q = torch.softmax(logits.float(), -1)[token] if sampling.greedy else probs[-1][token]
        return float(q) < self.confidence_threshold

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
        kept, new_parents = most_confident(parents, scores, self.tree_nodes)
        q = None if greedy else torch.stack(q_rows)[kept]  # (N, V)
        score = torch.tensor(scores, dtype=torch.float32)  # (N,) cumulative draft log-probabilities
        parent = torch.tensor(parents, dtype=torch.long)  # (N,)
        confidence = (score - torch.where(parent >= 0, score[parent.clamp_min(0)], 0.0)).exp()  # q(node | parent)
        return Draft(torch.tensor(tokens, dtype=torch.long)[kept], q, new_parents, None, confidence[kept])

    def begin(self, target, cache) -> None:
        pass

    def observe(self, result: VerifyResult) -> None:
        pass
