"""The grammar as a drafter: where structured output leaves one continuation only (a key, punctuation, the rest of an
enum value, closing braces), its tokens are proposed as a draft that costs nothing to make, as jump-forward decoding
does (SGLang, Zheng et al. 2024, arXiv 2312.07104, Sec. 3.3), but verified by the target like any draft, so the
output is the target's own: a forced token is a deterministic draft token (greedy: kept only where it is the
target's argmax; sampling: its q row a point mass, accepted with probability p(token), the rest drawn from the
residual; Leviathan et al. 2023, Algorithm 1), and the tokenization the grammar's string is given in never reaches
the output unverified.

:class:`GrammarDrafter` wraps the sequence's drafter (or none) and a processor that forces tokens
(:class:`~specdraft.sampling.ForcesTokens`, e.g. :class:`~specdraft.grammar.GrammarProcessor`):

- a draft model's chain (:class:`~specdraft.drafters.draft_model.DraftModelDrafter`, alone or with chain copies) gets
  the forced tokens spliced in at every depth where the grammar forces one (its ``fill``), the model drafting the
  other depths and catching up over the forced tokens in one forward when it next drafts;
- any other drafter (prompt lookup, a tree, none) drafts after the forced run at the start of the draft: the run,
  then the drafter's draft from the context the run extends.

Where the grammar is complete and allows nothing but the stop token, the run ends with it (and nothing is drafted
after it); where that happens after the target's own token, the sequence commits the stop token in the same step
(:meth:`~specdraft.sequence.SequenceState.commit`): p there is a point mass on it, so no target forward is spent
confirming it.

Whether a depth is forced depends only on the context and the tokens drafted before it, so the draft's length and
q stay a stopping time of the drafting process (exactness as :class:`~specdraft.drafters.combined.WithChainCopies`).
The forced tokens live in the sequence's generated text, which starts after ``prompt_length`` tokens.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from specdraft.drafters.base import Draft, Drafter, NoDrafter
from specdraft.drafters.combined import Combination, WithChainCopies
from specdraft.drafters.draft_model import DraftModelDrafter
from specdraft.sampling import ForcesTokens, SamplingConfig
from specdraft.trees import chain_parents, is_chain

GRAMMAR = 2  # Draft.source of a forced token (draft_model.py's MODEL 0, SIBLING 1, COPY 10 + n)


class GrammarDrafter(Combination):
    """``inner``'s draft (``inner`` None: no other drafter) with the tokens ``forcing`` forces after the sequence's
    generated text (the context past ``prompt_length``) proposed where they are forced (module docstring)."""

    def __init__(self, inner: Drafter | None, forcing: ForcesTokens, prompt_length: int,
                 stop_token_ids: tuple[int, ...] = ()) -> None:
        super().__init__(inner if inner is not None else NoDrafter())
        self.forcing, self.prompt_length = forcing, prompt_length
        self.stop_token_ids = frozenset(stop_token_ids)  # a forced run that ends with one ends the answer
        self.name = "grammar" if isinstance(self.inner, NoDrafter) else f"{self.inner.name}+grammar"
        if hasattr(self.inner, "online_version"):  # the version tag online distillation puts on its drafters
            self.online_version = self.inner.online_version
        self._committed = prompt_length  # the context's length at this step's propose: what follows is drafted
        self._depths = 0  # this step's num_draft_tokens
        self._run: tuple[torch.Tensor, list[int], bool] = (torch.zeros(0, dtype=torch.long), [], False)

    def forced(self, context: torch.Tensor, limit: int, committed: int | None = None) -> list[int]:
        """Up to ``limit`` tokens the grammar forces after ``context`` (N,): the prompt and generated text, then
        (past ``committed`` tokens, the whole context by default) draft tokens. The last run found is reused for the
        same context, or one that extends it by the run's first tokens, when it holds enough tokens (or all)."""
        committed = context.shape[0] if committed is None else committed
        before, run, whole = self._run  # the context the run follows, its tokens, whether it is the whole run
        done = context.shape[0] - before.shape[0]
        if 0 <= done < len(run) and (whole or done + limit <= len(run)) and \
                torch.equal(context[:before.shape[0]], before) and context[before.shape[0]:].tolist() == run[:done]:
            return run[done:done + limit]
        generated = context[self.prompt_length:committed]
        run = self.forcing.forced_tokens(generated, context[committed:], limit) if limit > 0 else []
        self._run = (context, run, len(run) < limit)
        return run

    def _splices(self) -> bool:
        """Whether the inner drafter drafts a chain whose depths can be filled (a draft model in chain mode)."""
        inner = self.inner.inner if isinstance(self.inner, WithChainCopies) else self.inner
        return isinstance(inner, DraftModelDrafter) and not inner.tree_branching

    def propose(self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        run = self.forced(context, num_draft_tokens)
        if run and run[-1] in self.stop_token_ids:  # the answer ends there: nothing to draft after it
            return after_run(torch.tensor(run, dtype=torch.long), None, self.inner.vocab_size)
        if self._splices():
            self._committed, self._depths = context.shape[0], num_draft_tokens
            return self.inner.chain(context, num_draft_tokens, sampling, generator, self._fill).draft
        if not run:
            return self.inner.propose(context, num_draft_tokens, sampling, generator)
        forced = torch.tensor(run, dtype=torch.long)  # (k,)
        rest = num_draft_tokens - len(run)
        draft = self.inner.propose(torch.cat([context, forced]), rest, sampling, generator) if rest else None
        return after_run(forced, draft, self.inner.vocab_size)

    def _fill(self, running: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """The forced token at the depth after ``running`` (the context and the chain so far), or None."""
        run = self.forced(running, max(1, self._committed + self._depths - running.shape[0]), self._committed)
        return (torch.tensor(run[0]), GRAMMAR) if run else None

    def draft_kind(self, context: torch.Tensor, sampling: SamplingConfig) -> Hashable:
        """"grammar" where the draft would start with a forced token; else the inner drafter's kind."""
        return "grammar" if self.forced(context, 1) else super().draft_kind(context, sampling)


def after_run(forced: torch.Tensor, draft: Draft | None, vocab_size: int | None) -> Draft:
    """The draft of the ``forced`` (k,) tokens, then ``draft`` (drafted after them; a chain or a tree whose roots
    hang below the run's last token). A draft with an auxiliary branch is left out (its positions follow the
    context, not the run)."""
    k = forced.shape[0]
    source = torch.full((k,), GRAMMAR)
    confidence = torch.full((k,), float("nan"))
    if draft is None or len(draft) == 0 or draft.aux is not None:
        return Draft(forced, confidence=confidence, source=source)
    parents = draft.parents if draft.parents is not None else chain_parents(len(draft))
    parents = torch.cat([chain_parents(k), torch.where(parents < 0, k - 1, parents + k)])  # (k + n,)
    q = None
    if draft.q is not None:  # the run's rows: point masses on the forced tokens
        q = torch.cat([torch.nn.functional.one_hot(forced, draft.q.shape[-1]).to(draft.q.dtype), draft.q])
    inner_confidence = draft.confidence if draft.confidence is not None else torch.full((len(draft),), float("nan"))
    inner_source = draft.source if draft.source is not None else torch.zeros(len(draft), dtype=torch.long)
    return Draft(torch.cat([forced, draft.tokens]), q, None if is_chain(parents) else parents, None,
                 torch.cat([confidence, inner_confidence]), torch.cat([source, inner_source]), draft.rollback
                 if draft.parents is None else None)
