"""BiLD (lossy, opt-in): the rollback rule on hand-computed logits, the fallback policy, exactness at rollback 0
(greedy equality in fp32, chi-square of sampled sequences), a loose setting that does change the answer, and the
options."""

import math
from collections import Counter

import pytest
import torch

from specdraft.decoding import generate
from specdraft.drafters import Draft, parse_options
from specdraft.drafters.bild import BiLDDrafter
from specdraft.drafters.registry import make_named
from specdraft.errors import SpecdraftError
from specdraft.models.native_llama import NativeLlama
from specdraft.sampling import SamplingConfig
from specdraft.sequence import GenerationConfig
from specdraft.verification import verify, within_rollback
from toys import assert_sequences_follow, bigram_sequence_probs, random_bigram, tiny_llama

GREEDY = SamplingConfig()
PROMPTS = [[5, 9, 3, 17, 9, 3, 22, 40], [1, 2, 3, 4], [30, 31, 7, 7, 12]]


def _logits(*rows: list[float]) -> torch.Tensor:
    """Logits whose softmax is the given probability rows, (R, V)."""
    return torch.tensor(rows).log()


@pytest.mark.parametrize("rollback, accepted, next_token", [
    (None, 1, 0),  # exact: token 2 at position 1 is not the argmax 0
    (0.0, 1, 0),  # rollback 0 is exact
    (1.0, 1, 0),  # -log 0.3 = 1.20 > 1: rolled back, the target writes its argmax
    (1.3, 2, 0),  # within: kept; then -log 0.05 = 3.00 at position 2 is rolled back
    (3.5, 3, 1),  # everything kept; the bonus is the argmax of the last row
])
def test_rollback_rule_greedy(rollback, accepted, next_token):
    tokens = torch.tensor([1, 2, 1])
    logits = _logits([0.2, 0.7, 0.1], [0.6, 0.1, 0.3], [0.85, 0.05, 0.1], [0.1, 0.8, 0.1])  # (γ + 1, V)
    result = verify(tokens, None, None, logits, GREEDY, None, rollback)
    assert (result.num_accepted, result.next_token) == (accepted, next_token)


def test_within_rollback_is_the_cross_entropy_of_the_drafted_token():
    log_p = torch.tensor([[0.25, 0.75], [0.9, 0.1]]).log()
    tokens = torch.tensor([0, 1])
    assert within_rollback(tokens, log_p, None) is None
    assert within_rollback(tokens, log_p, math.log(4) + 1e-6).tolist() == [True, False]
    assert within_rollback(tokens, log_p, math.log(10) + 1e-6).tolist() == [True, True]


def test_rollback_applies_to_chains_only():
    with pytest.raises(SpecdraftError, match="rollback"):
        Draft(torch.tensor([1, 2]), parents=torch.tensor([-1, -1]), rollback=1.0)
    with pytest.raises(SpecdraftError, match="rollback"):
        Draft(torch.tensor([1]), rollback=-1.0)
    assert Draft(torch.tensor([1, 2]), rollback=1.0).select(torch.tensor([0]), None).rollback == 1.0


def test_fallback_stops_before_the_first_unsure_position():
    """A bigram small model: drafting stops where the largest probability after the last token is below fallback,
    leaving that position to the target."""
    model = random_bigram(6, seed=2, scale=2.0)
    top = torch.softmax(model.table, -1).max(-1).values  # (V,) the largest probability after each token
    for fallback in (0.0, 0.4, 0.6, 1.0):
        drafter = BiLDDrafter(model, fallback=fallback, rollback=0.0)
        context = torch.tensor([0, 3])
        draft = drafter.propose(context, 6, GREEDY, None)
        last = [3] + draft.tokens.tolist()
        assert all(float(top[t]) >= fallback for t in last[:-1])
        assert len(draft) == 6 or float(top[last[-1]]) < fallback
        assert draft.rollback == 0.0 and draft.q is None


def _self_and_other():
    target = NativeLlama.from_hf(tiny_llama(0))
    return target, {"self": target, "other": NativeLlama.from_hf(tiny_llama(1, layers=1))}


@pytest.mark.parametrize("small", ["self", "other"])
@pytest.mark.parametrize("fallback", [0.0, 0.3])
def test_rollback_zero_is_greedy_exact(small, fallback):
    """fp32, rollback 0: every answer equals plain decoding, whether the small model is right (the target itself)
    or often wrong (another random model)."""
    target, models = _self_and_other()
    drafter = BiLDDrafter(models[small], fallback=fallback, rollback=0.0)
    for prompt in PROMPTS:
        plain = generate(target, prompt, None, GenerationConfig(30)).token_ids
        result = generate(target, prompt, drafter, GenerationConfig(30, 4, speculation="fixed"))
        assert result.token_ids == plain
        stats = result.stats
        if small == "self":  # the target drafting for itself is always right; without a fallback, γ + 1 a step
            assert stats.draft_tokens_accepted == stats.draft_tokens_proposed > 0
            assert fallback or stats.block_efficiency > 4.0


def test_a_loose_rollback_changes_the_answer():
    """rollback 30 nats keeps nearly every small-model token: the target only writes each step's last token, so
    the answers differ from plain decoding, with about γ + 1 tokens per target forward."""
    target, models = _self_and_other()
    drafter = BiLDDrafter(models["other"], fallback=0.0, rollback=30.0)
    differ = 0
    for prompt in PROMPTS:
        plain = generate(target, prompt, None, GenerationConfig(30)).token_ids
        result = generate(target, prompt, drafter, GenerationConfig(30, 4, speculation="fixed"))
        differ += result.token_ids != plain
        assert result.stats.block_efficiency > 4.0
    assert differ == len(PROMPTS)



@pytest.mark.parametrize("sampling", [SamplingConfig(1.0), SamplingConfig(0.8, top_k=3)])
def test_rollback_zero_samples_follow_the_target(sampling):
    """Three sampled tokens follow the target's warped distribution (chi-square) at rollback 0, with the fallback
    cutting drafts at the small model's unsure positions."""
    target, small = random_bigram(5, seed=0), random_bigram(5, seed=1)
    drafter = BiLDDrafter(small, fallback=0.7, rollback=0.0)  # after tokens 0 and 3 the small model is unsure
    generator = torch.Generator().manual_seed(5)
    trials, config = 4000, GenerationConfig(3, 3, sampling, speculation="fixed")
    counts = Counter(tuple(generate(target, [0, 1, 2, 3], drafter, config, generator).token_ids)
                     for _ in range(trials))
    assert drafter.fallbacks > 0
    assert_sequences_follow(counts, bigram_sequence_probs(target, [0, 1, 2, 3], 3, sampling), trials)


def test_named_drafter_options():
    target, models = _self_and_other()
    small = models["other"]
    with pytest.raises(SpecdraftError, match="fallback"):
        BiLDDrafter(small, fallback=1.5)
    with pytest.raises(SpecdraftError, match="rollback"):
        BiLDDrafter(small, rollback=-0.1)
    with pytest.raises(SpecdraftError, match="draft model"):  # a target with no shipped drafter
        make_named("bild", target, None, parse_options("fallback=0.5;rollback=2"))
    with pytest.raises(SpecdraftError, match="draft model"):
        make_named("gsd", target, None, {})
