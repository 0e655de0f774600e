"""Exact greedy block efficiency τ of a drafter on the target's own greedy answers, without decoding.

In greedy chain drafting every draft token after an accepted one is predicted from the target's own prefix, so the
accepted length of a block starting at response position t is the run of consecutive positions from t where the
drafter's argmax equals the target's token, capped at γ; the target then adds one token (recovered or bonus) and the
next block starts after it (:func:`greedy_blocks`). One teacher-forced forward of the drafter over each answer gives
every position's match (:func:`response_ranks`), so τ at any γ costs one pass over the answers: the held-out metric
``finetune --eval-data`` logs at every evaluation and ``benchmarks/heldout_tvd.py`` prints per drafter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def greedy_blocks(matches: list[bool], num_draft_tokens: int, sibling_hits: list[bool] | None = None
                  ) -> tuple[int, int, int]:
    """(tokens, blocks, blocks whose first draft token is accepted) of greedy chain speculative decoding over one
    response, from ``matches[t]`` = the drafter's argmax at response position t equals the target's token there;
    ``sibling_hits[t]``: the target's token there is among the drafter's runners-up (siblings beside the chain)."""
    tokens = blocks = first = t = 0
    while t < len(matches):
        accepted = 0
        while accepted < num_draft_tokens and t + accepted < len(matches) and matches[t + accepted]:
            accepted += 1
        if sibling_hits is not None and accepted < num_draft_tokens and t + accepted < len(matches):
            accepted += sibling_hits[t + accepted]  # the rejected depth's sibling leaf
        emitted = min(accepted + 1, len(matches) - t)  # accepted tokens, then the target's own (recovered or bonus)
        tokens, blocks, first, t = tokens + emitted, blocks + 1, first + (accepted > 0), t + emitted
    return tokens, blocks, first


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
            row[f"greedy_tau@{gamma}:copy{m}"], row[f"greedy_first_accept@{gamma}:copy{m}"] = pooled(
                greedy_blocks([h == 1 if h >= 0 else r == 0 for r, h in zip(rs, hs, strict=True)], gamma)
                for rs, hs in zip(ranks, hits, strict=True))
    for gamma in gammas:
        for k in (0, *siblings):
            tau, first = pooled(greedy_blocks([r == 0 for r in rs], gamma, [0 < r <= k for r in rs] if k else None)
                                for rs in ranks)
            row[f"greedy_tau@{gamma}" + (f"+{k}" if k else "")] = tau
            if not k:
                row[f"greedy_first_accept@{gamma}"] = first
    return row
