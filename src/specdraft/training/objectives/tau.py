"""Exact greedy block efficiency τ of a draft model on the target's own greedy answers, without decoding.

In greedy chain drafting every draft token after an accepted one is predicted from the target's own prefix, so the
accepted length of a block starting at response position t is the run of consecutive positions from t where the
drafter's argmax equals the target's token, capped at γ; the target then adds one token (recovered or bonus) and the
next block starts after it (:func:`specdraft.tau.greedy_steps`, :func:`greedy_blocks`). One teacher-forced forward
of the drafter over each answer gives every position's match (:func:`response_ranks`), so τ at any γ costs one pass
over the answers: ``greedy_tau@γ``, which ``finetune --eval-data`` logs at every evaluation and
``benchmarks/heldout_tvd.py`` prints per drafter. Heads that draft from roots (GliDe, EAGLE-3) give the same walk
from their training unroll (:func:`chain_tau`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from specdraft.tau import FIRST_ACCEPT, TAU, greedy_steps, leading, metric, tally


def greedy_blocks(matches: list[bool], num_draft_tokens: int, sibling_hits: list[bool] | None = None
                  ) -> tuple[int, int, int]:
    """(tokens, blocks, blocks whose first draft token is accepted) of greedy chain speculative decoding over one
    response, from ``matches[t]`` = the drafter's argmax at response position t equals the target's token there;
    ``sibling_hits[t]``: the target's token there is among the drafter's runners-up (siblings beside the chain)."""
    def accepted(t: int) -> int:
        count = leading(matches[t : t + num_draft_tokens], num_draft_tokens)
        if sibling_hits is not None and count < num_draft_tokens and t + count < len(matches):
            count += sibling_hits[t + count]  # the rejected depth's sibling leaf
        return count

    return tally(greedy_steps(accepted, len(matches)))


def response_ranks(draft_logits: Callable[[dict], torch.Tensor], batches: list[dict], keep: torch.Tensor | None,
                   top: int = 4) -> list[list[int]]:
    """Per response and position: the rank of the response token among the drafter's ``top`` most likely tokens
    (0 = its greedy token), ``top`` where it is not among them.

    Args:
        draft_logits: batch -> the drafter's logits (n, N or V) at the batch's response positions, row-major
            (:func:`specdraft.training.drafter.distillation.draft_logits_fn`: on the drafter's device).
        batches: :func:`~specdraft.training.data.batches.collate_distill` batches of the answers.
        keep: (N,) the draft vocabulary the logits' columns stand for, or None.
    """
    out = []
    for batch in batches:
        draft = draft_logits(batch)  # (n, N or V)
        guesses = draft.topk(top, dim=-1).indices.cpu()  # (n, top)
        guesses = guesses if keep is None else keep.cpu()[guesses]  # target ids
        found = guesses == batch["labels"][batch["mask"]].cpu().unsqueeze(-1)  # (n, top)
        ranks = torch.where(found.any(-1), found.int().argmax(-1), top).tolist()
        start = 0
        for length in batch["mask"].sum(1).tolist():
            out.append(ranks[start:start + length])
            start += length
    return out


def greedy_tau(ranks: list[list[int]], gammas: list[int], siblings: list[int] = (),
               copies: dict[int, list[list[int]]] | None = None) -> dict[str, float]:
    """Pooled τ and first-token acceptance per γ over responses (see :func:`greedy_blocks`), τ with k siblings
    per depth for each k in ``siblings``, and τ with copies inside the chain for each m in ``copies`` ({m: per
    response and position, -1 where ``chain_copy=m`` has no copy, 1 where its copy is the token, 0 where not}).

    Args:
        ranks: per response and position, the rank of the target's token among the drafter's (:func:`response_ranks`).
    """
    def pooled(blocks) -> tuple[float, float]:  # (τ, first-token acceptance) over the responses' blocks
        tokens, count, first = (sum(x) for x in zip(*blocks, strict=True))
        return tokens / max(count, 1), first / max(count, 1)

    row = {}
    for m, hits in (copies or {}).items():
        for gamma in gammas:
            row[metric(TAU, gamma, f":copy{m}")], row[metric(FIRST_ACCEPT, gamma, f":copy{m}")] = pooled(
                greedy_blocks([h == 1 if h >= 0 else r == 0 for r, h in zip(rs, hs, strict=True)], gamma)
                for rs, hs in zip(ranks, hits, strict=True))
    for gamma in gammas:
        for k in (0, *siblings):
            tau, first = pooled(greedy_blocks([r == 0 for r in rs], gamma, [0 < r <= k for r in rs] if k else None)
                                for rs in ranks)
            row[metric(TAU, gamma, f"+{k}" if k else "")] = tau
            if not k:
                row[metric(FIRST_ACCEPT, gamma)] = first
    return row


def chain_tau(hits: list[torch.Tensor], roots: torch.Tensor, gammas: Iterable[int]) -> dict[str, tuple[float, int]]:
    """Greedy chain decoding of a drafter that drafts from roots (heads: GliDe, EAGLE-3) replayed over held-out text
    (:func:`specdraft.tau.greedy_steps`), at each γ in ``gammas`` (at most ``len(hits)``): ``greedy_tau@γ`` =
    (new tokens, target forwards) and ``greedy_first_accept@γ`` = (steps whose first draft token is accepted, steps),
    pooled as sums and counts. Exact on the target's own greedy text.

    Response token j is drafted first from the j-th root of its row (the root of the first one being the prompt's
    end); a step there accepts the leading depths i whose draft token is the target's greedy token (``hits[i]`` at
    that root), at most γ and never past the response's end, then the target adds one token and the next step
    drafts from the root of the token after them.

    Args:
        hits: per depth i, (B, L) bool: the depth-(i+1) draft token from root t is the target's greedy token there.
        roots: (B, L) bool: one contiguous run per row, as long as the row's response.
    """
    out = {}
    table = torch.stack(hits, dim=-1).tolist()  # (B, L, depths)
    runs = [[t for t, r in enumerate(run) if r] for run in roots.tolist()]
    for k in gammas:
        tokens = steps = first = 0
        for row, where in zip(table, runs, strict=True):
            if where:
                start = where[0]
                walk = greedy_steps(lambda j, row=row, start=start, k=k: leading(row[start + j][:k], k), len(where))
                tokens, steps, first = (a + b for a, b in zip((tokens, steps, first), tally(walk), strict=True))
        out[metric(TAU, k)] = (float(tokens), steps)
        out[metric(FIRST_ACCEPT, k)] = (float(first), steps)
    return out
