import math

import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.training.objectives import losses
from specdraft.training.objectives.losses import (
    LOSSES,
    cross_entropy,
    distillation_loss,
    forward_kl,
    get_loss,
    jsd,
    loss_names,
    register,
    reverse_kl,
    skew_kl,
    tvd,
    tvd_plus_plus,
)

LOG2 = math.log(2.0)

# (loss name, options) pairs covering every loss and the TVD++ estimator variants.
CASES = [
    ("ce", {}),
    ("fkl", {}),
    ("rkl", {}),
    ("jsd", {"beta": 0.3}),
    ("tvd", {}),
    ("tvdpp", {}),
    ("tvdpp", {"normalization": "none"}),
    ("tvdpp", {"normalization": "vocab"}),
    ("tvdpp", {"weighting": "sample", "normalization": "none"}),
    ("tvdpp", {"weighting": "sample", "normalization": "vocab"}),
    ("tvdpp", {"weighting": "sample", "normalization": "batch"}),
    ("skl", {"alpha": 0.1}),
    ("srkl", {"alpha": 0.3}),
]
CASE_IDS = [name + "".join(f"-{v}" for v in options.values()) for name, options in CASES]


def logits_of(*rows: tuple[float, ...]) -> torch.Tensor:
    """Logits whose softmax is exactly the given probability rows."""
    return torch.tensor(rows, dtype=torch.float64).log().float()


def call(name: str, draft, target, labels, mask, options: dict) -> torch.Tensor:
    if options.get("weighting") == "sample":
        options = {**options, "generator": torch.Generator().manual_seed(7)}
    return distillation_loss(name, draft, target, labels, mask, **options)


def random_batch(n: int = 6, v: int = 5, scale: float = 2.0):
    draft = (torch.randn(n, v) * scale).requires_grad_()
    target = torch.randn(n, v) * scale
    labels = torch.randint(0, v, (n,))
    mask = torch.ones(n, dtype=torch.bool)
    mask[[1, 4]] = False
    return draft, target, labels, mask


def grad_of(loss: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(loss, leaf)
    return grad


# ---- hand-computed values ----


def test_cross_entropy_hand_computed():
    draft = logits_of((0.25, 0.75), (0.75, 0.25), (0.5, 0.5))
    labels = torch.tensor([1, 1, 0])
    mask = torch.tensor([True, True, False])
    expected = (-math.log(0.75) - math.log(0.25)) / 2
    assert cross_entropy(draft, labels, mask).item() == pytest.approx(expected, rel=1e-6)
    assert cross_entropy(draft, labels).item() == pytest.approx(
        (-math.log(0.75) - math.log(0.25) - math.log(0.5)) / 3, rel=1e-6
    )


def test_forward_and_reverse_kl_hand_computed():
    draft = logits_of((0.5, 0.5))  # q
    target = logits_of((0.25, 0.75))  # p
    fkl = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    rkl = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert forward_kl(draft, target).item() == pytest.approx(fkl, rel=1e-5)
    assert reverse_kl(draft, target).item() == pytest.approx(rkl, rel=1e-5)
    assert fkl != pytest.approx(rkl, rel=1e-2)  # the two directions are told apart


def test_forward_kl_zero_target_mass_counts_zero():
    draft = logits_of((0.5, 0.5))
    target = torch.tensor([[0.0, -math.inf]])  # p = (1, 0)
    assert forward_kl(draft, target).item() == pytest.approx(math.log(1 / 0.5), rel=1e-6)


def _hand_jsd(p: list[float], q: list[float], beta: float) -> float:
    m = [beta * pi + (1 - beta) * qi for pi, qi in zip(p, q, strict=True)]
    kl_pm = sum(pi * math.log(pi / mi) for pi, mi in zip(p, m, strict=True))
    kl_qm = sum(qi * math.log(qi / mi) for qi, mi in zip(q, m, strict=True))
    return beta * kl_pm + (1 - beta) * kl_qm


@pytest.mark.parametrize("beta", [0.5, 0.2, 0.9])
def test_jsd_hand_computed(beta):
    p, q = [0.25, 0.75], [0.5, 0.5]
    # beta = 0.5 by hand: m = (0.375, 0.625)
    half = 0.5 * (0.25 * math.log(0.25 / 0.375) + 0.75 * math.log(0.75 / 0.625)) + 0.5 * (
        0.5 * math.log(0.5 / 0.375) + 0.5 * math.log(0.5 / 0.625)
    )
    assert _hand_jsd(p, q, 0.5) == pytest.approx(half)
    value = jsd(logits_of(tuple(q)), logits_of(tuple(p)), beta=beta).item()
    assert value == pytest.approx(_hand_jsd(p, q, beta), rel=1e-4)
    # beta weighs p (the target) in the mixture, as in TRL: the mirrored convention gives another number
    assert value != pytest.approx(_hand_jsd(p, q, 1 - beta), rel=1e-2) or beta == 0.5


def test_jsd_of_disjoint_distributions_is_log2_at_half():
    draft, target = torch.tensor([[30.0, -30.0]]), torch.tensor([[-30.0, 30.0]])
    assert jsd(draft, target, beta=0.5).item() == pytest.approx(LOG2, rel=1e-5)


def test_tvd_hand_computed():
    draft = logits_of((0.5, 0.25, 0.25), (0.1, 0.1, 0.8))
    target = logits_of((0.2, 0.3, 0.5), (0.9, 0.05, 0.05))
    mask = torch.tensor([True, False])
    assert tvd(draft, target, mask).item() == pytest.approx(0.5 * (0.3 + 0.05 + 0.25), rel=1e-5)
    assert tvd(draft, target).item() == pytest.approx((0.3 + 0.8) / 2, rel=1e-5)


def test_tvdpp_surrogate_hand_computed():
    eps = 1e-6
    q1, p1 = (0.5, 0.25, 0.25), (0.2, 0.3, 0.5)  # r = (0, 1, 1)
    q2, p2 = (0.25, 0.25, 0.5), (0.5, 0.25, 0.25)  # r = (1, 0, 0)
    draft, target = logits_of(q1, q2), logits_of(p1, p2)
    r1, r2 = (0, 1, 1), (1, 0, 0)

    def surrogate(q, adv):
        return -sum(qx * ax * math.log(qx) for qx, ax in zip(q, adv, strict=True))

    none = (surrogate(q1, r1) + surrogate(q2, r2)) / 2
    assert surrogate(q1, r1) == pytest.approx(LOG2)  # -2 * 0.25 * log 0.25
    assert tvd_plus_plus(draft, target, normalization="none", eps=eps).item() == pytest.approx(none, rel=1e-5)

    def vocab_adv(q, r):
        mean = sum(qx * rx for qx, rx in zip(q, r, strict=True))
        std = math.sqrt(sum(qx * (rx - mean) ** 2 for qx, rx in zip(q, r, strict=True)))
        return [(rx - mean) / (std + eps) for rx in r]

    vocab = (surrogate(q1, vocab_adv(q1, r1)) + surrogate(q2, vocab_adv(q2, r2))) / 2
    assert tvd_plus_plus(draft, target, normalization="vocab", eps=eps).item() == pytest.approx(vocab, rel=1e-5)

    mean = (0.5 + 0.25) / 2  # pooled q-mass on tokens with p > q
    var = (
        sum(qx * (rx - mean) ** 2 for qx, rx in zip(q1, r1, strict=True))
        + sum(qx * (rx - mean) ** 2 for qx, rx in zip(q2, r2, strict=True))
    ) / 2
    assert var == pytest.approx(mean * (1 - mean))

    def batch_adv(r):
        return [(rx - mean) / (math.sqrt(var) + eps) for rx in r]

    batch = (surrogate(q1, batch_adv(r1)) + surrogate(q2, batch_adv(r2))) / 2
    assert tvd_plus_plus(draft, target, normalization="batch", eps=eps).item() == pytest.approx(batch, rel=1e-5)
    assert len({round(none, 4), round(vocab, 4), round(batch, 4)}) == 3  # the three normalisations differ here


# ---- properties ----


def test_jsd_endpoints_are_the_two_kls():
    draft, target, _, mask = random_batch()
    assert torch.equal(jsd(draft, target, mask, beta=0.0), forward_kl(draft, target, mask))
    assert torch.equal(jsd(draft, target, mask, beta=1), reverse_kl(draft, target, mask))
    assert not torch.allclose(forward_kl(draft, target, mask), reverse_kl(draft, target, mask))


def test_jsd_near_endpoints_scales_like_the_kls():
    draft, target, _, mask = random_batch(scale=1.0)
    small = 1e-3
    assert (jsd(draft, target, mask, beta=small) / small).item() == pytest.approx(
        forward_kl(draft, target, mask).item(), rel=2e-2
    )
    assert (jsd(draft, target, mask, beta=1 - small) / small).item() == pytest.approx(
        reverse_kl(draft, target, mask).item(), rel=2e-2
    )


def test_jsd_is_symmetric_under_swapping_p_q_and_beta():
    draft, target, _, mask = random_batch()
    for beta in (0.5, 0.2, 0.7):
        swapped = jsd(target, draft.detach(), mask, beta=1 - beta)
        assert torch.allclose(jsd(draft, target, mask, beta=beta), swapped, atol=1e-6)
    assert jsd(draft, target, mask, beta=0.5).item() <= LOG2


def test_tvd_is_zero_iff_equal_and_at_most_one():
    draft, target, _, mask = random_batch()
    assert tvd(draft, draft.detach() + 3.0, mask).item() == pytest.approx(0.0, abs=1e-7)  # softmax is shift-free
    per_position = [tvd(draft[i : i + 1], target[i : i + 1]).item() for i in range(draft.shape[0])]
    assert all(0.0 < value <= 1.0 for value in per_position)
    disjoint = tvd(torch.tensor([[50.0, -50.0]]), torch.tensor([[-50.0, 50.0]])).item()
    assert disjoint == pytest.approx(1.0, abs=1e-6)
    assert disjoint <= 1.0


def _no_ties(draft: torch.Tensor, target: torch.Tensor) -> None:
    gap = (torch.softmax(draft.detach(), -1) - torch.softmax(target, -1)).abs()
    assert gap.min().item() > 1e-4  # r = 1{p > q} is well defined and TVD is differentiable


def test_tvdpp_without_normalization_has_the_tvd_gradient():
    draft, target, _, mask = random_batch(n=8, v=7)
    _no_ties(draft, target)
    expected = grad_of(tvd(draft, target, mask), draft)
    got = grad_of(tvd_plus_plus(draft, target, mask, weighting="q", normalization="none"), draft)
    assert expected[mask].abs().max().item() > 1e-2
    assert torch.allclose(got, expected, atol=1e-6)


def _under_covered_mass(draft: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """s = Σ_x q(x) 1{p(x) > q(x)} per position; r is 0/1 so its std under q is sqrt(s (1 - s))."""
    q, p = torch.softmax(draft.detach(), -1), torch.softmax(target, -1)
    return (q * (p > q)).sum(-1)  # (N,)


def test_tvdpp_vocab_gradient_is_tvd_gradient_over_each_position_std():
    eps = 1e-6
    draft, target, _, mask = random_batch(n=8, v=7)
    _no_ties(draft, target)
    s = _under_covered_mass(draft, target)
    std = (s * (1 - s)).sqrt()  # (N,)
    assert std[mask].std().item() > 0.02  # positions are scaled differently, so a global factor would fail
    expected = grad_of(tvd(draft, target, mask), draft) / (std[:, None] + eps)
    got = grad_of(tvd_plus_plus(draft, target, mask, normalization="vocab", eps=eps), draft)
    assert torch.allclose(got, expected, atol=1e-6, rtol=1e-5)


def test_tvdpp_batch_gradient_is_tvd_gradient_over_pooled_std():
    eps = 1e-6
    draft, target, _, mask = random_batch(n=8, v=7)
    _no_ties(draft, target)
    mean = _under_covered_mass(draft, target)[mask].mean()
    scale = 1.0 / ((mean * (1 - mean)).sqrt() + eps)
    assert scale.item() > 1.5
    expected = grad_of(tvd(draft, target, mask), draft) * scale
    got = grad_of(tvd_plus_plus(draft, target, mask, normalization="batch", eps=eps), draft)
    assert torch.allclose(got, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("normalization", ["none", "vocab"])
def test_tvdpp_sampled_gradient_averages_to_the_exact_one(normalization):
    draws, n, v = 50_000, 3, 4
    draft = torch.tensor([[1.0, 0.0, -1.0, 0.5], [0.0, 0.3, 0.2, -0.4], [2.0, -1.0, 0.0, 0.0]], requires_grad=True)
    target = torch.tensor([[0.0, 1.0, 0.5, -1.0], [1.0, -0.5, 0.0, 0.5], [0.0, 1.0, 1.5, -1.0]])
    _no_ties(draft, target)
    exact = grad_of(tvd_plus_plus(draft, target, normalization=normalization), draft)
    repeated = draft.expand(draws, n, v)  # (draws, N, V): one independent draw per copy of each position
    generator = torch.Generator().manual_seed(0)
    sampled = tvd_plus_plus(
        repeated, target.expand(draws, n, v), weighting="sample", normalization=normalization, generator=generator
    )
    averaged = grad_of(sampled, draft)
    atol = 3e-3  # about twice the worst error seen over 10 seeds; the signal is over 10 times larger
    assert exact.abs().max().item() > 10 * atol
    assert torch.allclose(averaged, exact, atol=atol)


@pytest.mark.parametrize("normalization", ["none", "vocab", "batch"])
def test_tvdpp_sampled_surrogate_at_explicit_draws(normalization):
    eps = 1e-6
    draft, target, _, mask = random_batch(n=8, v=4)
    q, p = torch.softmax(draft.detach()[mask], -1).tolist(), torch.softmax(target[mask], -1).tolist()
    tokens = torch.multinomial(torch.tensor(q), 1, generator=torch.Generator().manual_seed(5))[:, 0].tolist()
    rewards = [float(pi[x] > qi[x]) for pi, qi, x in zip(p, q, tokens, strict=True)]
    if normalization == "none":
        advantages = rewards
    elif normalization == "vocab":  # r standardised under q at each position, then read at the drawn token
        advantages = []
        for pi, qi, x in zip(p, q, tokens, strict=True):
            r = [float(a > b) for a, b in zip(pi, qi, strict=True)]
            mean = sum(b * rx for b, rx in zip(qi, r, strict=True))
            std = math.sqrt(sum(b * (rx - mean) ** 2 for b, rx in zip(qi, r, strict=True)))
            advantages.append((r[x] - mean) / (std + eps))
    else:  # the drawn rewards standardised over the batch
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        advantages = [(r - mean) / (std + eps) for r in rewards]
    assert len(set(rewards)) == 2
    expected = -sum(a * math.log(qi[x]) for a, qi, x in zip(advantages, q, tokens, strict=True)) / len(q)
    generator = torch.Generator().manual_seed(5)
    got = tvd_plus_plus(
        draft, target, mask, weighting="sample", normalization=normalization, eps=eps, generator=generator
    )
    assert got.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_tvdpp_sampling_uses_only_the_given_generator():
    draft, target, _, mask = random_batch(n=32, v=9)
    values = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        generator = torch.Generator().manual_seed(3)
        values.append(tvd_plus_plus(draft, target, mask, weighting="sample", generator=generator))
    assert torch.equal(values[0], values[1])
    other = tvd_plus_plus(draft, target, mask, weighting="sample", generator=torch.Generator().manual_seed(4))
    assert not torch.equal(values[0], other)


@pytest.mark.parametrize(("name", "options"), CASES, ids=CASE_IDS)
def test_masked_positions_change_nothing(name, options):
    draft, target, labels, mask = random_batch()
    loss = call(name, draft, target, labels, mask, options)
    grad = grad_of(loss, draft)
    assert loss.item() != 0.0
    changed_draft = draft.detach().clone()
    changed_draft[~mask] = torch.tensor([100.0, -3.0, math.nan, math.inf, 0.0])
    changed_draft.requires_grad_()
    changed_target = target.clone()
    changed_target[~mask] = math.nan
    changed_labels = labels.clone()
    changed_labels[~mask] = -100
    changed_loss = call(name, changed_draft, changed_target, changed_labels, mask, options)
    changed_grad = grad_of(changed_loss, changed_draft)
    assert torch.equal(changed_loss, loss)
    assert torch.equal(changed_grad[mask], grad[mask])
    assert torch.equal(changed_grad[~mask], torch.zeros_like(changed_grad[~mask]))


@pytest.mark.parametrize(("name", "options"), CASES, ids=CASE_IDS)
def test_all_false_mask_gives_zero_with_grad(name, options):
    draft, target, labels, _ = random_batch()
    loss = call(name, draft, target, labels, torch.zeros(6, dtype=torch.bool), options)
    assert loss.item() == 0.0
    assert loss.dtype == torch.float32
    assert torch.equal(grad_of(loss, draft), torch.zeros_like(draft))


@pytest.mark.parametrize(("name", "options"), CASES, ids=CASE_IDS)
def test_batch_time_shapes_match_flat(name, options):
    draft, target, labels, mask = random_batch()
    flat = call(name, draft, target, labels, mask, options)
    nested = call(name, draft.view(2, 3, 5), target.view(2, 3, 5), labels.view(2, 3), mask.view(2, 3), options)
    assert torch.equal(nested, flat)


@pytest.mark.parametrize(("name", "options"), CASES, ids=CASE_IDS)
def test_bf16_inputs_give_fp32_results(name, options):
    draft, target, labels, mask = random_batch()
    draft_bf16 = draft.detach().bfloat16().requires_grad_()
    target_bf16 = target.bfloat16()
    loss = call(name, draft_bf16, target_bf16, labels, mask, options)
    reference = call(name, draft_bf16.detach().float(), target_bf16.float(), labels, mask, options)
    assert loss.dtype == torch.float32
    assert torch.equal(loss, reference)  # upcast before any arithmetic: nothing is computed in bf16
    assert grad_of(loss, draft_bf16).dtype == torch.bfloat16


# ---- validation and dispatch ----


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"weighting": "greedy"}, "weighting"),
        ({"normalization": "global"}, "normalization"),
        ({"weighting": "sample"}, "generator"),
    ],
)
def test_bad_tvdpp_options_raise(options, named):
    draft, target, _, mask = random_batch()
    with pytest.raises(SpecdraftError, match=named):
        tvd_plus_plus(draft, target, mask, **options)


@pytest.mark.parametrize("beta", [-0.1, 1.5, math.nan])
def test_beta_out_of_range_raises(beta):
    draft, target, _, mask = random_batch()
    with pytest.raises(SpecdraftError, match="beta"):
        jsd(draft, target, mask, beta=beta)


def test_bad_shapes_raise():
    draft, target, labels, mask = random_batch()
    with pytest.raises(SpecdraftError, match="mask"):
        forward_kl(draft, target, mask[:-1])
    with pytest.raises(SpecdraftError, match="mask"):
        forward_kl(draft, target, mask.long())
    with pytest.raises(SpecdraftError, match="target_logits"):
        tvd(draft, target[:, :-1], mask)
    with pytest.raises(SpecdraftError, match="labels"):
        cross_entropy(draft, labels[:-1], mask)


def test_every_registered_loss_is_in_the_shared_cases():
    assert {name for name, _ in CASES} == set(LOSSES)


def test_registry_and_dispatcher():
    assert set(LOSSES) == {"ce", "fkl", "rkl", "jsd", "tvd", "tvdpp", "skl", "srkl"}
    draft, target, labels, mask = random_batch()
    assert torch.equal(distillation_loss("ce", draft, None, labels, mask), cross_entropy(draft, labels, mask))
    assert torch.equal(distillation_loss("rkl", draft, target, None, mask), reverse_kl(draft, target, mask))
    assert torch.equal(distillation_loss("jsd", draft, target, None, mask, beta=0.0), forward_kl(draft, target, mask))
    with pytest.raises(SpecdraftError, match="'kl'"):
        distillation_loss("kl", draft, target, labels, mask)
    with pytest.raises(SpecdraftError, match="beta"):
        distillation_loss("fkl", draft, target, labels, mask, beta=0.5)
    with pytest.raises(SpecdraftError, match="target_logits"):
        distillation_loss("tvd", draft, None, labels, mask)
    with pytest.raises(SpecdraftError, match="labels"):
        distillation_loss("ce", draft, target, None, mask)


def test_registry_entries_say_what_each_front_may_use():
    assert [name for name, loss in LOSSES.items() if not loss.needs_target] == ["ce"]
    assert loss_names(online=True) == loss_names(eagle3=True) == ("fkl", "tvd", "tvdpp", "skl", "srkl")
    assert {o.name for o in LOSSES["tvdpp"].options} == {"weighting", "normalization"}
    assert LOSSES["tvdpp"].takes_generator and not LOSSES["skl"].takes_generator
    assert LOSSES["jsd"].settings() == {"beta": 0.5} and LOSSES["jsd"].settings({"beta": "0.25"}) == {"beta": 0.25}
    assert LOSSES["fkl"].settings() == {} and get_loss("skl", online=True) is LOSSES["skl"]
    with pytest.raises(SpecdraftError, match="loss must be one of fkl, tvd, tvdpp, skl, srkl, got 'rkl'"):
        get_loss("rkl", online=True)
    with pytest.raises(SpecdraftError, match="has no option 'alpha'; its options are beta"):
        LOSSES["jsd"].settings({"alpha": 0.1})
    with pytest.raises(SpecdraftError, match="takes no option"):
        LOSSES["fkl"].settings({"beta": 0.1})
    with pytest.raises(SpecdraftError, match=r"option beta must be a number in \[0, 1\], got 'x'"):
        LOSSES["jsd"].settings({"beta": "x"})
    with pytest.raises(SpecdraftError, match="option weighting must be one of q, sample"):
        LOSSES["tvdpp"].settings({"weighting": "all"})


def test_register_refuses_an_entry_that_would_mislead(monkeypatch):
    monkeypatch.setattr(losses, "LOSSES", dict(LOSSES))
    with pytest.raises(ValueError, match="twice"):
        register("fkl", summary="again")(forward_kl)
    with pytest.raises(ValueError, match="alpha already means something else"):
        register("other", summary="x", options=(losses.LossOption("alpha", 0.5, "another alpha"),))(skew_kl)
    with pytest.raises(ValueError, match="keyword-only parameter"):
        register("bare", summary="x", options=(losses.BETA,))(forward_kl)
    with pytest.raises(ValueError, match="train against p"):
        register("online_ce", summary="x", reference="labels", online=True)
