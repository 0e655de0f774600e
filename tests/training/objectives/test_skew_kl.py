"""DistiLLM's skew KL and skew reverse KL (Ko et al. 2024, arXiv 2402.03898): hand-computed values, exact endpoints
(α = 0 is forward / reverse KL), the bound the skew buys, the relation to JSD, and their registry entries. The
losses' shared properties (masking, dtype, empty masks, gradients) are checked with every other loss in
test_losses.py."""

import math

import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.training.objectives.losses import (
    LOSSES,
    forward_kl,
    jsd,
    reverse_kl,
    skew_kl,
    skew_reverse_kl,
)


def logits_of(*rows: tuple[float, ...]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).log().float()


P, Q = (0.25, 0.75), (0.5, 0.5)


def test_skew_kl_hand_computed():
    # α = 0.1: m = 0.1 p + 0.9 q = (0.475, 0.525); KL(p || m) = 0.25 ln(10/19) + 0.75 ln(10/7)
    expected = 0.25 * math.log(10 / 19) + 0.75 * math.log(10 / 7)
    assert expected == pytest.approx(0.1070427, abs=1e-7)
    assert skew_kl(logits_of(Q), logits_of(P), alpha=0.1).item() == pytest.approx(expected, rel=1e-5)


def test_skew_reverse_kl_hand_computed():
    # α = 0.1: m = 0.9 p + 0.1 q = (0.275, 0.725); KL(q || m) = 0.5 ln(20/11) + 0.5 ln(20/29)
    expected = 0.5 * math.log(20 / 11) + 0.5 * math.log(20 / 29)
    assert expected == pytest.approx(0.1131367, abs=1e-7)
    assert skew_reverse_kl(logits_of(Q), logits_of(P), alpha=0.1).item() == pytest.approx(expected, rel=1e-5)


def test_the_default_is_distillms_alpha():
    draft, target = torch.randn(4, 7), torch.randn(4, 7)
    assert torch.equal(skew_kl(draft, target), skew_kl(draft, target, alpha=0.1))
    assert LOSSES["skl"].settings() == LOSSES["srkl"].settings() == {"alpha": 0.1}


def test_alpha_zero_is_plain_kl_exactly_and_alpha_near_one_vanishes():
    draft, target = torch.randn(5, 9) * 3, torch.randn(5, 9) * 3
    mask = torch.tensor([True, False, True, True, False])
    assert torch.equal(skew_kl(draft, target, mask, alpha=0.0), forward_kl(draft, target, mask))
    assert torch.equal(skew_reverse_kl(draft, target, mask, alpha=0.0), reverse_kl(draft, target, mask))
    for loss in (skew_kl, skew_reverse_kl):
        assert abs(loss(draft, target, mask, alpha=1 - 1e-6).item()) < 1e-4  # float32 rounding either side of 0


def test_the_skew_bounds_the_loss_where_q_misses_p():
    """KL(p || a p + (1 - a) q) <= -log a whatever q: where q is ~0 under p's mass forward KL explodes."""
    target = logits_of((0.5, 0.5 - 1e-12, 1e-12))
    draft = logits_of((1e-12, 1e-12, 1.0 - 2e-12))
    assert forward_kl(draft, target).item() > 20
    for alpha in (0.1, 0.5):
        assert skew_kl(draft, target, alpha=alpha).item() <= -math.log(alpha) + 1e-6
        assert skew_reverse_kl(target, draft, alpha=alpha).item() <= -math.log(alpha) + 1e-6


def test_at_one_half_the_two_skews_add_up_to_twice_the_jsd():
    draft, target = torch.randn(6, 5), torch.randn(6, 5)
    both = skew_kl(draft, target, alpha=0.5) + skew_reverse_kl(draft, target, alpha=0.5)
    torch.testing.assert_close(both, 2 * jsd(draft, target, beta=0.5), rtol=1e-5, atol=1e-6)


def test_the_gradient_reaches_the_draft_only_and_vanishes_at_q_equal_p():
    target = torch.randn(3, 6)
    for loss in (skew_kl, skew_reverse_kl):
        draft = target.clone().requires_grad_()
        value = loss(draft, target, alpha=0.2)
        (grad,) = torch.autograd.grad(value, draft)
        assert abs(value.item()) < 1e-6 and grad.abs().max() < 1e-6
        draft = torch.randn(3, 6, requires_grad=True)
        loss(draft, target, alpha=0.2).backward()
        assert draft.grad.abs().sum() > 0


@pytest.mark.parametrize("alpha", [1.0, -0.1, "x", float("nan")])
def test_alpha_outside_zero_one_is_refused(alpha):
    draft, target = torch.randn(2, 3), torch.randn(2, 3)
    for loss in (skew_kl, skew_reverse_kl):
        with pytest.raises(SpecdraftError, match=r"alpha must be a number in \[0, 1\)"):
            loss(draft, target, alpha=alpha)


def test_registry_entries():
    for name, function in (("skl", skew_kl), ("srkl", skew_reverse_kl)):
        loss = LOSSES[name]
        assert loss.function is function and loss.needs_target and loss.online and loss.eagle3
        assert [o.name for o in loss.options] == ["alpha"] and loss.settings({"alpha": "0.25"}) == {"alpha": 0.25}
