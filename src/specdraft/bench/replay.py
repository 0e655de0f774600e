"""Greedy replay: the block efficiency τ a drafter would reach on recorded greedy answers, without the target.

Under greedy decoding speculative output equals plain output token for token, so the accepted length of every step
is fixed by the plain answer: a draft (chain or tree) is accepted along its longest root path that spells the next
answer tokens, and the step commits that path plus one token. Replaying a drafter over ``ar``'s recorded answers
therefore gives, for drafters whose proposals depend on the context alone (draft models with any of their options,
prompt lookup, REST), exactly the accept lengths a real run would record in float32, at the cost of the drafter's
forwards only. In bfloat16 a real run can differ where a wide verify and a one-token step round differently. A drafter
says whether it can be replayed in its facts (``DrafterFacts.replayable``). Each step's draft is decided as the
decoding loop decides it with fixed speculation (:func:`specdraft.sequence.speculation_policy`,
:func:`specdraft.speculation.propose`): at most ``min(γ, max_new_tokens - generated - 1)`` draft tokens, trees cut to
that depth.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from specdraft.drafters.base import Draft, Drafter, facts_of
from specdraft.errors import SpecdraftError
from specdraft.sampling import SamplingConfig
from specdraft.sequence import GenerationConfig, speculation_policy
from specdraft.speculation import StepBounds, propose
from specdraft.tau import greedy_steps
from specdraft.trees import chain_parents, follow_path


def replayable(drafter: Drafter) -> bool:
    """Whether ``drafter``'s proposals are a function of the context (its facts say so; a combination's are those of
    the drafter inside it)."""
    return facts_of(drafter).replayable


def accepted_length(draft: Draft, continuation: Sequence[int], max_depth: int) -> int:
    """Greedy verification against a known continuation: the depth of the longest root path of ``draft`` (at most
    ``max_depth`` deep) whose tokens are the first tokens of ``continuation``."""
    parents = draft.parents if draft.parents is not None else chain_parents(len(draft))
    limit = min(max_depth, len(continuation))
    return len(follow_path(draft.tokens, parents, lambda row, depth: continuation[depth] if depth < limit else None))


def replay(drafter: Drafter, prompt_ids: Sequence[int], answer_ids: Sequence[int], num_draft_tokens: int,
           max_new_tokens: int, target=None) -> list[int]:
    """Tokens committed per step (Spec-Bench's ``accept_lengths``) if ``drafter`` had drafted, greedily, the answer
    ``answer_ids`` that plain greedy decoding gave after ``prompt_ids`` with ``max_new_tokens``. ``target`` (never
    run) is handed to the drafter's ``begin``, as REST reads its vocabulary size there."""
    if not replayable(drafter):
        raise SpecdraftError(f"cannot replay {type(drafter).__name__}: only drafters whose proposals depend on the "
                             "context alone (their facts say replayable: draft models, prompt lookup, REST)")
    if num_draft_tokens < 1 or len(answer_ids) > max_new_tokens:
        raise SpecdraftError(f"need num_draft_tokens >= 1 and an answer of at most max_new_tokens ({max_new_tokens}) "
                             f"tokens, got {num_draft_tokens} and {len(answer_ids)}")
    if target is not None:
        drafter.begin(target, None)
    prompt, answer = [int(t) for t in prompt_ids], [int(t) for t in answer_ids]
    config = GenerationConfig(max_new_tokens, num_draft_tokens, speculation="fixed")
    greedy, policy = SamplingConfig(), speculation_policy(config, target, drafter)

    def accepted(done: int) -> int:  # the greedy walk over the answer (specdraft.tau) asks where each step starts
        context = torch.tensor(prompt + answer[:done], dtype=torch.long)  # (L,)
        bounds = StepBounds(max_new_tokens - done - 1, sys.maxsize, sys.maxsize)  # no cache or position limits
        draft = propose(policy, drafter, context, len(context) - 1, bounds, greedy, None)
        return accepted_length(draft, answer[done:], num_draft_tokens)

    return [committed for _, committed in greedy_steps(accepted, len(answer))]
