import math

import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.models import rowgemm
from specdraft.sampling import (
    SamplingConfig,
    argmax,
    check_finite,
    checked_argmax,
    sample,
    sample_on_device,
    warp,
)


def test_greedy_is_one_hot_argmax():
    probs = warp(torch.tensor([[0.1, 3.0, -1.0], [5.0, 0.0, 4.0]]), SamplingConfig())
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_temperature_scales_logits():
    logits = torch.tensor([1.0, 2.0, 4.0])
    expected = torch.softmax(logits / 0.5, -1)
    assert torch.allclose(warp(logits, SamplingConfig(temperature=0.5)), expected)


def test_top_k_keeps_k_largest():
    probs = warp(torch.tensor([1.0, 4.0, 3.0, 2.0]), SamplingConfig(temperature=1.0, top_k=2))
    expected = torch.softmax(torch.tensor([4.0, 3.0]), -1)
    assert probs[[0, 3]].tolist() == [0.0, 0.0]
    assert torch.allclose(probs[[1, 2]], expected)


def test_top_p_keeps_smallest_set_reaching_mass():
    probs_in = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs_in.log()
    kept = warp(logits, SamplingConfig(temperature=1.0, top_p=0.8))  # 0.5 + 0.3 reaches 0.8
    assert torch.allclose(kept, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8, atol=1e-6)
    kept = warp(logits, SamplingConfig(temperature=1.0, top_p=0.81))  # needs the third token
    assert torch.allclose(kept, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95, atol=1e-6)
    kept = warp(logits, SamplingConfig(temperature=1.0, top_p=0.1))  # always keeps the most likely
    assert kept.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_top_k_then_top_p_compose():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    kept = warp(logits, SamplingConfig(temperature=2.0, top_k=3, top_p=0.7))
    base = torch.softmax(torch.tensor([3.0, 2.0, 1.0]) / 2.0, -1)  # [0.506, 0.307, 0.186]
    assert torch.allclose(kept[0, :2], base[:2] / base[:2].sum(), atol=1e-6)
    assert kept[0, 2:].sum() == 0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"temperature": 10**400}, "temperature"),
        ({"temperature": 1e39}, "temperature"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": "high"}, "top_p"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(SpecdraftError, match=field):
        SamplingConfig(**kwargs)


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-6])
def test_a_temperature_below_the_greedy_limit_is_greedy_not_nan(temperature):
    """fp32 cannot divide by such a temperature (1e-300 is 0 in fp32, so logits / T is inf or NaN): greedy, the
    T -> 0 limit, instead."""
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9]])
    sampling = SamplingConfig(temperature=temperature)
    assert sampling.greedy
    assert warp(logits, sampling).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert not SamplingConfig(temperature=1e-4).greedy
    assert torch.isfinite(warp(logits, SamplingConfig(temperature=1e-4))).all()


def test_sample_follows_generator():
    probs = torch.tensor([[0.2, 0.3, 0.5]]).repeat(1000, 1)
    a = sample(probs, torch.Generator().manual_seed(3))
    b = sample(probs, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    assert abs((a == 2).float().mean().item() - 0.5) < 0.06


def test_sampling_on_the_device_draws_what_multinomial_draws():
    """Same tokens and the same generator state after, over several draws, with zero-probability tokens too."""
    probs = torch.softmax(torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 3, -1)
    probs[:, 5:15] = 0.0
    probs = probs / probs.sum(-1, keepdim=True)  # (6, 40)
    for seed in range(3):
        ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        for _ in range(4):
            assert torch.equal(sample_on_device(probs, ours), sample(probs, theirs))
        assert torch.equal(ours.get_state(), theirs.get_state())
    assert sample_on_device(probs[0], None).shape == ()


def test_check_finite():
    check_finite(torch.zeros(3), "target")
    with pytest.raises(SpecdraftError, match=r"non-finite logits .* target"):
        check_finite(torch.tensor([0.0, math.nan]), "target")
    with pytest.raises(SpecdraftError, match="non-finite"):
        check_finite(torch.tensor([[1.0, 2.0], [-math.inf, 0.0]]), "draft")
    check_finite(torch.full((4,), 3e38), "target")  # huge but finite: the sum overflows, the entries do not


@pytest.mark.parametrize("kernel", [False, True])
def test_checked_argmax_is_check_finite_then_argmax(kernel, monkeypatch):
    """With the row kernels loaded (one pass over the rows) and without them: the same ids, the same error."""
    if kernel and not rowgemm.available():
        pytest.skip("the row kernels do not build here")
    monkeypatch.setattr(rowgemm, "loaded", lambda: kernel)
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 49_157, generator=generator)
    logits[1, [3, 40_000]] = 9.0  # a tie: the first
    logits[2, -1] = 9.0  # past the last whole vector
    logits[3] = 0.0
    logits[3, 7] = -0.0  # -0 equals +0: the first
    assert checked_argmax(logits, "target") == argmax(logits).tolist() == logits.argmax(-1).tolist()
    assert checked_argmax(logits[:1, :5], "target") == logits[:1, :5].argmax(-1).tolist()
    for bad in (math.nan, math.inf, -math.inf):
        for column in (11, 49_156):  # in a vector, in the tail
            broken = logits.clone()
            broken[4, column] = bad
            with pytest.raises(SpecdraftError, match=r"non-finite logits .* target"):
                checked_argmax(broken, "target")
    checked_argmax(torch.full((2, 40), 3e38), "target")  # huge but finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_argmax_is_torchs_first_largest_entry(dtype):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 6, (5, 49), generator=generator).to(dtype)  # many ties in every row
    for rows in (logits, logits[0], logits[:, ::2], logits.t()):
        got = argmax(rows)
        assert got.dtype == torch.long and got.shape == rows.shape[:-1]
        assert torch.equal(got, rows.argmax(-1))
    assert int(argmax(torch.tensor([2.0, 7.0, 7.0, 1.0]))) == 1
