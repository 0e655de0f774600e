"""Verification: greedy exact match, and speculative sampling whose output distribution is exactly the target's
(exact enumeration of one step on a toy vocabulary)."""

import itertools

import pytest
import torch

from specdraft.sampling import SamplingConfig, warp
from specdraft.verification import (
    acceptance_probabilities,
    point_mass,
    residual_distribution,
    verify_greedy,
    verify_sampling,
)

V = 4


def _logits(prefix: tuple[int, ...], seed: int) -> torch.Tensor:
    """A deterministic toy distribution depending on the whole prefix. (V,)"""
    generator = torch.Generator().manual_seed(hash((prefix, seed)) % (1 << 31))
    return torch.randn(V, generator=generator, dtype=torch.float64) * 2


def _step_distribution(gamma: int, sampling: SamplingConfig, deterministic_draft: bool) -> dict:
    """Exact distribution of the first gamma + 1 tokens when one speculative step emits a prefix of them and the
    rest follow the target (the induction step of Leviathan et al. 2023, Theorem 1), by enumerating every draft."""
    p_of = {}

    def p(prefix):
        if prefix not in p_of:
            p_of[prefix] = warp(_logits(prefix, 0), sampling).double()
        return p_of[prefix]

    def q(prefix):
        if deterministic_draft:  # the draft proposes its argmax: q is a point mass
            return point_mass(_logits(prefix, 1).argmax().view(1), V)[0].double()
        return warp(_logits(prefix, 1), sampling).double()

    def complete(prefix, prob, out):  # emitted prefix, then tokens from the target up to gamma + 1
        if len(prefix) == gamma + 1:
            out[prefix] = out.get(prefix, 0.0) + prob
            return
        for token, pt in enumerate(p(prefix).tolist()):
            if pt > 0:
                complete(prefix + (token,), prob * pt, out)

    out: dict = {}
    for draft in itertools.product(range(V), repeat=gamma):
        q_rows = torch.stack([q(draft[:i]) for i in range(gamma)])  # (γ, V)
        prob_draft = float(torch.prod(q_rows[torch.arange(gamma), torch.tensor(draft)]))
        if prob_draft == 0:
            continue
        p_rows = torch.stack([p(draft[:i]) for i in range(gamma + 1)])  # (γ + 1, V)
        accept = acceptance_probabilities(torch.tensor(draft), p_rows, q_rows).tolist()
        reach = prob_draft
        for i in range(gamma):  # rejected at position i: recovered token from the residual
            residual = residual_distribution(p_rows[i], q_rows[i]).tolist()
            for token, r in enumerate(residual):
                complete(draft[:i] + (token,), reach * (1 - accept[i]) * r, out)
            reach *= accept[i]
        for token, pt in enumerate(p_rows[gamma].tolist()):  # all accepted: bonus token
            out[draft + (token,)] = out.get(draft + (token,), 0.0) + reach * pt
    return out, p


@pytest.mark.parametrize("deterministic_draft", [False, True])
@pytest.mark.parametrize(
    "sampling",
    [SamplingConfig(1.0), SamplingConfig(0.7, top_k=3), SamplingConfig(1.3, top_p=0.8), SamplingConfig(0.9, 2, 0.9)],
)
@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_exact_enumeration_matches_target(gamma, sampling, deterministic_draft):
    got, p = _step_distribution(gamma, sampling, deterministic_draft)
    max_err = 0.0
    for seq in itertools.product(range(V), repeat=gamma + 1):
        want = 1.0
        for i in range(gamma + 1):
            want *= float(p(seq[:i])[seq[i]])
        max_err = max(max_err, abs(got.get(seq, 0.0) - want))
    assert max_err < 1e-6
    assert abs(sum(got.values()) - 1.0) < 1e-6


def test_residual_is_positive_part_renormalised():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.equal(residual_distribution(p, p), p)  # degenerate case falls back to p


def test_acceptance_probabilities():
    p = torch.tensor([[0.5, 0.5], [0.1, 0.9], [1.0, 0.0]])
    q = torch.tensor([[0.25, 0.75], [0.2, 0.8]])
    assert torch.allclose(acceptance_probabilities(torch.tensor([1, 0]), p, q), torch.tensor([2 / 3, 0.5]))


def test_greedy_accepts_matching_prefix_then_corrects():
    logits = torch.eye(5)[[3, 1, 4, 0]] * 10  # target argmax: 3, 1, 4, 0
    assert verify_greedy(torch.tensor([3, 1, 2]), logits) == verify_greedy(torch.tensor([3, 1, 0]), logits)
    result = verify_greedy(torch.tensor([3, 1, 2]), logits)
    assert (result.num_accepted, result.next_token, result.bonus) == (2, 4, False)
    result = verify_greedy(torch.tensor([3, 1, 4]), logits)
    assert (result.num_accepted, result.next_token, result.bonus) == (3, 0, True)
    result = verify_greedy(torch.tensor([0, 1, 4]), logits)
    assert (result.num_accepted, result.next_token) == (0, 3)
    result = verify_greedy(torch.empty(0, dtype=torch.long), logits[:1])
    assert (result.num_accepted, result.next_token, result.bonus) == (0, 3, True)


def test_sampling_with_point_mass_on_certain_target_always_accepts():
    p = torch.eye(4)[[2, 3, 1]]  # the target is certain of 2, 3, then 1
    for seed in range(20):
        result = verify_sampling(torch.tensor([2, 3]), None, p, torch.Generator().manual_seed(seed))
        assert (result.num_accepted, result.next_token) == (2, 1)
        result = verify_sampling(torch.tensor([2, 0]), None, p, torch.Generator().manual_seed(seed))
        assert (result.num_accepted, result.next_token) == (1, 3)


def test_sampling_is_reproducible_with_generator():
    p = torch.softmax(torch.randn(4, 10), -1)
    q = torch.softmax(torch.randn(3, 10), -1)
    draft = torch.tensor([1, 2, 3])
    runs = [verify_sampling(draft, q, p, torch.Generator().manual_seed(7)) for _ in range(2)]
    assert runs[0] == runs[1]
