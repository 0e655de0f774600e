"""Lossless verification of a drafted chain against the target.

Glossary (as vLLM's rejection sampler): the leading draft tokens the target keeps are **accepted**; at the first
rejection the target supplies a **recovered** token; when every draft token is accepted it supplies a **bonus**
token from its distribution at the next position. Each target forward therefore yields ``num_accepted + 1`` tokens.

One lossy relaxation, opt-in per draft (``rollback``): BiLD's rollback policy (Kim et al. 2023, *Speculative
Decoding with Big Little Decoder*, NeurIPS, Sec. 3.3). A chain's token is rolled back only where the exact test
rejects it *and* its distance d = -log p(token) (the cross-entropy of the draft's hard label under the target's
distribution) exceeds the rollback threshold α; a token within α is kept although the target would not have chosen
it. α = 0 keeps exactly what the exact test keeps, so the output is exact again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdraft.errors import SpecdraftError
from specdraft.sampling import SamplingConfig, argmax, sample, warp
from specdraft.trees import children, depths, follow_path


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one draft block."""

    num_draft_tokens: int  # γ actually proposed this step
    num_accepted: int  # leading draft tokens kept, 0..num_draft_tokens
    next_token: int  # the recovered token (on rejection) or the bonus token (all accepted)

    aux_logits: torch.Tensor | None = None  # (A, V) logits of the draft's auxiliary branch, when it had one
    hidden: torch.Tensor | None = None  # (F, D) target features of the F tokens committed and fed this step

    @property
    def bonus(self) -> bool:
        return self.num_accepted == self.num_draft_tokens

    @property
    def positions(self) -> int:
        """Draft positions (depths) this step offered: γ for a chain."""
        return self.num_draft_tokens

    @property
    def accepted_nodes(self) -> tuple[int, ...]:
        """The accepted nodes, root first: the leading ``num_accepted`` nodes of a chain."""
        return tuple(range(self.num_accepted))


def verify(
    tokens: torch.Tensor,
    parents: torch.Tensor | None,
    q: torch.Tensor | None,
    target_logits: torch.Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    rollback: float | None = None,
    target_tokens: list[int] | None = None,
) -> VerifyResult:
    """Verify a draft on the target's logits: greedy exact match or speculative sampling (p warped once, here), on a
    chain (``parents`` None) or a token tree. Every decoding loop verifies through this one dispatch.

    Args:
        tokens: (N,) drafted ids; parents: (N,) the tree, or None for a chain; q: (N, V) or None (a point mass).
        target_logits: (N + 1, V) the target's logits at the root (row 0) and at every node (row i + 1).
        rollback: None (exact), or BiLD's rollback threshold α for a chain (lossy when > 0; module docstring).
        target_tokens: the argmax of every row of ``target_logits`` when the caller has it (greedy sampling only),
            else None.
    """
    if rollback is not None and parents is not None:
        raise SpecdraftError("a rollback threshold (BiLD) applies to chain drafts, not token trees")
    gamma = tokens.shape[0]
    if parents is None:
        if sampling.greedy:
            tolerated = None if rollback is None else within_rollback(
                tokens, torch.log_softmax(target_logits[:gamma].float(), -1), rollback)  # log p: (γ, V)
            return verify_greedy(tokens, target_logits, tolerated, target_tokens)
        p = warp(target_logits, sampling)  # (γ + 1, V)
        return verify_sampling(tokens, q, p, generator, within_rollback(tokens, p[:gamma].log(), rollback))
    if sampling.greedy:
        return verify_tree_greedy(tokens, parents, target_logits, target_tokens)
    return verify_tree_sampling(tokens, parents, q, warp(target_logits, sampling), generator)


def within_rollback(draft_tokens: torch.Tensor, log_p: torch.Tensor, rollback: float | None) -> torch.Tensor | None:
    """BiLD's rollback test, negated: whether each draft token's distance d = -log p(token) is at most the rollback
    threshold α (Kim et al. 2023, Sec. 3.3). None when ``rollback`` is None (exact verification).

    Args:
        draft_tokens: (γ,); log_p: (γ, V) the target's log-probabilities at each draft position.
    Returns:
        (γ,) bool, or None.
    """
    if rollback is None:
        return None
    distance = -log_p.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # (γ,)
    return distance <= rollback


def _leading(flags: list[bool]) -> int:
    """Length of the run of True at the start of ``flags`` (γ entries: a list is cheaper than tensor ops)."""
    return next((i for i, flag in enumerate(flags) if not flag), len(flags))


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor,
                  tolerated: torch.Tensor | None = None, target_tokens: list[int] | None = None) -> VerifyResult:
    """Greedy exact match: accept the longest draft prefix equal to the target's argmax (or ``tolerated``, (γ,)
    bool: kept anyway, a lossy rule such as :func:`within_rollback`).

    Args:
        draft_tokens: (γ,) drafted ids.
        target_logits: (γ + 1, V) target logits at the positions predicting each draft token and the one after.
        target_tokens: their argmax when the caller has it (γ + 1 ids), else None.
    """
    if target_tokens is None:
        target_tokens = argmax(target_logits).tolist()  # γ + 1 ids
    drafted = draft_tokens.tolist()
    kept = [a == b for a, b in zip(drafted, target_tokens, strict=False)]  # γ flags
    if tolerated is not None:
        kept = [k or t for k, t in zip(kept, tolerated.tolist(), strict=True)]
    num_accepted = _leading(kept)
    return VerifyResult(len(drafted), num_accepted, target_tokens[num_accepted])


def point_mass(draft_tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """q of a deterministic drafter: one-hot rows (γ, V) at the drafted tokens."""
    return torch.nn.functional.one_hot(draft_tokens, vocab_size).float()


def acceptance_probabilities(draft_tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """min(1, p(x_i) / q(x_i)) for each draft token (Leviathan et al. 2023, Alg. 1).

    Args:
        draft_tokens: (γ,); p: (≥γ, V) target probabilities; q: (γ, V) draft probabilities.
    Returns:
        (γ,) acceptance probabilities.
    """
    idx = draft_tokens.unsqueeze(-1)  # (γ, 1)
    p_x = p[: draft_tokens.shape[0]].gather(-1, idx).squeeze(-1)  # (γ,)
    q_x = q.gather(-1, idx).squeeze(-1)  # (γ,)
    return torch.clamp(p_x / q_x, max=1.0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)), the distribution of the recovered token (Leviathan et al. 2023, Alg. 1;
    Chen et al. 2023). Sampled as is, never re-warped. Falls back to p where p == q numerically.

    Args:
        p, q: (..., V) probabilities. Returns (..., V).
    """
    residual = torch.clamp(p - q, min=0.0)
    total = residual.sum(-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp_min(1e-30), p)


def verify_sampling(
    draft_tokens: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, generator: torch.Generator | None,
    tolerated: torch.Tensor | None = None,
) -> VerifyResult:
    """Speculative sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023, Alg. 2): the emitted tokens are
    distributed exactly as sampling from p one token at a time.

    Args:
        draft_tokens: (γ,) drafted ids.
        q: (γ, V) draft probabilities, or None for a deterministic draft (treated as a point mass).
        p: (γ + 1, V) warped target probabilities.
        generator: the source of every random draw.
        tolerated: None, or (γ,) bool: tokens kept whatever the test draws (a lossy rule, :func:`within_rollback`).
    """
    gamma = draft_tokens.shape[0]
    if q is None:
        q = point_mass(draft_tokens, p.shape[-1])
    uniforms = torch.rand(gamma, generator=generator)  # (γ,)
    kept = uniforms < acceptance_probabilities(draft_tokens, p, q)  # (γ,)
    num_accepted = _leading((kept if tolerated is None else kept | tolerated).tolist())
    if num_accepted < gamma:
        next_token = sample(residual_distribution(p[num_accepted], q[num_accepted]), generator)
    else:
        next_token = sample(p[gamma], generator)
    return VerifyResult(gamma, num_accepted, int(next_token))


@dataclass(frozen=True)
class TreeVerifyResult(VerifyResult):
    """Outcome of verifying a token tree: ``num_draft_tokens`` counts its nodes, ``accepted_nodes`` is the accepted
    root-to-node path (node indices, length ``num_accepted``), ``depth`` the tree's depth."""

    accepted_nodes: tuple[int, ...] = ()
    depth: int = 0

    @property
    def positions(self) -> int:
        return self.depth


def verify_tree_greedy(tokens: torch.Tensor, parents: torch.Tensor, target_logits: torch.Tensor,
                       target_tokens: list[int] | None = None) -> TreeVerifyResult:
    """Greedy tree verification: from the root, follow the child equal to the target's argmax while there is one
    (the longest path agreeing with greedy decoding; Medusa, Cai et al. 2024; SpecInfer, Miao et al. 2024).

    Args:
        tokens, parents: (N,) the tree (:mod:`specdraft.trees`).
        target_logits: (N + 1, V) logits at the root (row 0) and at every node (row i + 1).
        target_tokens: their argmax when the caller has it (N + 1 ids), else None.
    """
    best = argmax(target_logits).tolist() if target_tokens is None else target_tokens  # (N + 1,)
    path = follow_path(tokens, parents, lambda row, depth: best[row])
    row = path[-1] + 1 if path else 0
    depth = int(depths(parents).max()) if parents.numel() else 0
    return TreeVerifyResult(tokens.shape[0], len(path), best[row], accepted_nodes=tuple(path), depth=depth)


def verify_tree_sampling(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    generator: torch.Generator | None,
) -> TreeVerifyResult:
    """Multi-draft recursive rejection sampling over a token tree (SpecInfer, Miao et al. 2024, Alg. 2 "multi-step
    speculative sampling"): lossless, the emitted tokens follow p exactly.

    At the current node the children are tried in order. Child x drawn from q_x is accepted with probability
    min(1, p'(x) / q_x(x)); on rejection the residual becomes p' <- norm(max(0, p' - q_x)). A deterministic child
    (q None) is a point mass, so rejection removes x from p'. When every child is rejected the recovered token is
    drawn from the final residual; when a leaf is accepted the bonus token is drawn from p at the leaf.

    Args:
        tokens, parents: (N,) the tree.
        q: (N, V) the distribution each node was drawn from (siblings with q: independent draws from one row),
           or None for deterministic candidates.
        p: (N + 1, V) warped target probabilities at the root (row 0) and every node (row i + 1).
        generator: the source of every random draw.
    """

    kids, ids = children(parents), tokens.tolist()
    vocab = p.shape[-1]
    path, row = [], 0
    while True:
        residual = p[row]  # (V,)
        accepted = None
        for child in kids[row]:
            q_child = q[child] if q is not None else torch.nn.functional.one_hot(tokens[child], vocab).to(p.dtype)
            x = ids[child]
            ratio = residual[x] / q_child[x] if q_child[x] > 0 else torch.tensor(0.0)
            if float(torch.rand((), generator=generator)) < min(1.0, float(ratio)):
                accepted = child
                break
            residual = residual_distribution(residual, q_child)
        if accepted is None:
            next_token = int(sample(residual, generator))
            break
        path.append(accepted)
        row = accepted + 1
    depth = int(depths(parents).max()) if parents.numel() else 0
    return TreeVerifyResult(len(ids), len(path), next_token, accepted_nodes=tuple(path), depth=depth)
