"""Layer-skip self-speculative decoding (Draft & Verify): the layer-subset forward against transformers, greedy
equality and sampled-distribution tests, deterministic calibration and its cache file."""

import copy
import json
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from specdraft.decoding import generate
from specdraft.drafters import layer_skip as layer_skip_module
from specdraft.drafters.layer_skip import LayerSkipDrafter, builtin_calibration_ids, calibrate_skip, parse_skip
from specdraft.drafters.registry import make_named
from specdraft.errors import SpecdraftError
from specdraft.models.native_llama import NativeLlama
from specdraft.sampling import SamplingConfig, warp
from specdraft.sequence import GenerationConfig
from toys import hf_target, tiny_llama, tiny_tokenizer

PROMPT = [5, 9, 3, 17, 9, 3, 22, 40]
CALIBRATION = [[1, 5, 9, 3, 17, 9, 3, 22, 40, 11, 12, 5, 9], [1, 5, 9, 30, 31, 7, 7, 8, 2, 60, 4]]


@pytest.fixture(autouse=True)
def _cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))


@pytest.fixture(scope="module")
def hf4():
    return tiny_llama(0, layers=4)


@pytest.fixture(scope="module")
def native4(hf4):
    return NativeLlama.from_hf(hf4)


def _logits(model, ids, layers=None, split=None):
    """Logits of ``ids`` on a fresh cache, fed in one forward or in two (prefill, then the rest)."""
    cache = model.new_cache(64)
    ids = torch.tensor([ids])
    if split is None:
        return model.forward(ids, cache, layers=layers)[0]
    first = model.forward(ids[:, :split], cache, layers=layers)[0]
    return torch.cat([first, model.forward(ids[:, split:], cache, layers=layers)[0]])


def test_all_layers_equal_the_default_forward(native4):
    assert torch.equal(_logits(native4, PROMPT, layers=[0, 1, 2, 3]), _logits(native4, PROMPT))


@pytest.mark.parametrize("kept", [[0, 3], [0, 2, 3], [1], [0, 1, 2]])
@pytest.mark.parametrize("split", [None, 5])
def test_layer_subset_matches_transformers_without_those_layers(hf4, native4, kept, split):
    reference = copy.deepcopy(hf4)
    reference.model.layers = torch.nn.ModuleList(reference.model.layers[i] for i in kept)
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT]), use_cache=False).logits[0]  # (N, V)
    torch.testing.assert_close(_logits(native4, PROMPT, kept, split), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layers", [[], [2, 1], [0, 0], [4], [-1]])
def test_bad_layer_subsets(native4, layers):
    with pytest.raises(SpecdraftError, match="increasing indices"):
        _logits(native4, PROMPT, layers)


@pytest.mark.parametrize("skip", ["1", "2", "3", "1,2", "0,3", "1,2,3"])
def test_greedy_equals_plain_decoding(native4, skip):
    plain = generate(native4, PROMPT, None, GenerationConfig(30)).token_ids
    result = generate(native4, PROMPT, LayerSkipDrafter(native4, skip=skip),
                      GenerationConfig(30, 4, speculation="fixed"))
    assert result.token_ids == plain
    if skip in ("2", "3"):  # one of four layers skipped: some drafts are accepted
        assert result.stats.block_efficiency > 1


def test_draft_leaves_the_cache_as_found(native4):
    drafter = LayerSkipDrafter(native4, skip="2")
    cache = native4.new_cache(64)
    drafter.begin(native4, cache)
    native4.forward(torch.tensor([PROMPT[:-1]]), cache)
    keys = [k.clone() for k in cache.keys]
    draft = drafter.propose(torch.tensor(PROMPT), 4, SamplingConfig(), None)
    assert len(draft) == 4 and draft.q is None and cache.length == len(PROMPT) - 1
    held = cache.length
    assert all(torch.equal(a[:, :, :held], b[:, :, :held]) for a, b in zip(keys, cache.keys, strict=True))


def _pool(counts: Counter, p: torch.Tensor, trials: int) -> tuple[list[float], list[float]]:
    """Observed and expected counts over tokens with expected count >= 5, plus one bucket for the rest."""
    support = (p * trials >= 5).nonzero().flatten().tolist()
    observed, expected = [counts[t] for t in support], [float(p[t]) * trials for t in support]
    rest = trials * (1 - float(p[support].sum()))
    if rest >= 5:
        observed.append(trials - sum(observed))
        expected.append(rest)
    else:
        assert trials - sum(observed) <= 5 + 4 * rest
    return observed, [e * sum(observed) / sum(expected) for e in expected]


def test_sampled_tokens_follow_the_target():
    """First and second sampled tokens have the target's marginals (q from the skipped model, speculative sampling)."""
    target = NativeLlama.from_hf(tiny_llama(0, layers=4, std=0.05))
    sampling = SamplingConfig(1.0)
    p_first = warp(_logits(target, PROMPT)[-1], sampling)  # (V,)
    p_second = sum(p_first[a] * warp(_logits(target, PROMPT + [a])[-1], sampling) for a in range(target.vocab_size))
    drafter = LayerSkipDrafter(target, skip="2")
    firsts, seconds, trials = Counter(), Counter(), 1500
    for seed in range(trials):
        generator = torch.Generator().manual_seed(seed)
        result = generate(target, PROMPT, drafter, GenerationConfig(2, 3, sampling, speculation="fixed"), generator)
        firsts[result.token_ids[0]] += 1
        seconds[result.token_ids[1]] += 1
    assert chisquare(*_pool(firsts, p_first, trials)).pvalue > 1e-3
    assert chisquare(*_pool(seconds, p_second, trials)).pvalue > 1e-3


def test_sampled_draft_carries_q(native4):
    drafter = LayerSkipDrafter(native4, skip="1")
    drafter.begin(native4, native4.new_cache(64))
    draft = drafter.propose(torch.tensor(PROMPT), 3, SamplingConfig(0.8, top_k=10), torch.Generator().manual_seed(0))
    assert draft.q.shape == (3, native4.vocab_size)
    assert torch.allclose(draft.q.sum(-1), torch.ones(3)) and ((draft.q > 0).sum(-1) <= 10).all()
    assert draft.q[torch.arange(3), draft.tokens].gt(0).all()


def test_proxy_equals_one_token_drafts_on_the_full_cache(native4):
    """The one-forward proxy predicts, at every position, what drafting one token after the full context does."""
    scorer = layer_skip_module._MatchScorer(native4, [PROMPT])
    predicted = scorer.predictions([0, 2])[0]
    for t in range(len(PROMPT)):
        cache = native4.new_cache(64)
        if t:
            native4.forward(torch.tensor([PROMPT[:t]]), cache)
        draft = native4.forward(torch.tensor([[PROMPT[t]]]), cache, layers=[0, 2])[0, -1]
        assert int(draft.argmax()) == int(predicted[t])
    full = _logits(native4, PROMPT).argmax(-1)
    assert scorer((1, 3)) == float((full == predicted).float().mean())


def test_calibration_is_deterministic_and_never_skips_the_ends():
    target = NativeLlama.from_hf(tiny_llama(1, layers=8))
    first = calibrate_skip(target, CALIBRATION, skip_ratio=0.5, search_steps=12, seed=3)
    again = calibrate_skip(target, CALIBRATION, skip_ratio=0.5, search_steps=12, seed=3)
    assert first == again and len(first.skip) == 4 and 0 not in first.skip and 7 not in first.skip
    assert first.evaluated <= 12 and 0 <= first.score <= 1
    exhaustive = calibrate_skip(target, CALIBRATION, skip_ratio=0.25, search_steps=100, seed=0)  # 15 sets of 2
    assert exhaustive.evaluated == 15 and exhaustive.score >= first.score


def test_calibration_of_a_deep_model_scores_only_its_budget():
    target = NativeLlama.from_hf(tiny_llama(2, layers=40, hidden=16))  # C(38, 20) sets: never enumerated
    found = calibrate_skip(target, CALIBRATION, skip_ratio=0.5, search_steps=4)
    assert found.evaluated == 4 and len(found.skip) == 20 and 0 not in found.skip and 39 not in found.skip


def test_calibrated_set_is_cached_and_reused(native4, tmp_path, monkeypatch):
    made = LayerSkipDrafter(native4, skip_ratio=0.25, calibration=CALIBRATION)
    stored = json.loads((tmp_path / "layer_skip.json").read_text())
    assert next(iter(stored.values()))["skip"] == list(made.skip) and len(made.skip) == 1
    assert made.name == f"layer-skip[{made.skip[0]}]"

    def fail(*args, **kwargs):
        raise AssertionError("recalibrated")

    monkeypatch.setattr(layer_skip_module, "calibrate_skip", fail)
    assert LayerSkipDrafter(native4, skip_ratio=0.25).skip == made.skip  # no calibration data needed: cached
    with pytest.raises(AssertionError, match="recalibrated"):
        LayerSkipDrafter(native4, skip_ratio=0.25, calibrate=True, calibration=CALIBRATION)
    with pytest.raises(AssertionError, match="recalibrated"):
        LayerSkipDrafter(native4, skip_ratio=0.5, calibration=CALIBRATION)  # another ratio: another key


def test_factory_options_and_transformers_target_error(native4):
    drafter = make_named("layer-skip", native4, None, {"skip": "1,2"})
    assert drafter.kept == [0, 3] and drafter.name == "layer-skip[1,2]"
    with pytest.raises(SpecdraftError, match="natively"):
        make_named("layer-skip", hf_target(0), None, {"skip": "1"})
    with pytest.raises(SpecdraftError, match="tokenizer"):
        make_named("layer-skip", native4, None, {})
    with pytest.raises(SpecdraftError, match="unknown drafter option"):
        make_named("layer-skip", native4, None, {"calibration": "1,2"})


def test_bad_options(native4):
    with pytest.raises(SpecdraftError, match=r"0 \.\. 3"):
        parse_skip("1,4", 4)
    with pytest.raises(SpecdraftError, match="comma-separated"):
        parse_skip("1;2", 4)
    with pytest.raises(SpecdraftError, match="all 4 layers"):
        parse_skip("0,1,2,3", 4)
    with pytest.raises(SpecdraftError, match="skip_ratio"):
        LayerSkipDrafter(native4, skip_ratio=1.0, calibration=CALIBRATION)
    with pytest.raises(SpecdraftError, match="never the first or last"):
        LayerSkipDrafter(native4, skip_ratio=0.9, calibration=CALIBRATION)
    with pytest.raises(SpecdraftError, match="different target"):
        LayerSkipDrafter(native4, skip="1").begin(NativeLlama.from_hf(tiny_llama(0, layers=4)), None)


def test_builtin_calibration_prompts_use_the_chat_template():
    sequences = builtin_calibration_ids(tiny_tokenizer())
    assert len(sequences) == 6  # one per Spec-Bench category
    assert all(ids[0] == 1 and len(ids) > 5 for ids in sequences)  # "<s> user ..." from the chat template
