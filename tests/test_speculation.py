"""Adaptive speculation: the policy's choices on hand-made cost curves, what it learns, and that output stays exact
with it on (greedy token for token, sampling by chi-square)."""

import math
from collections import Counter
from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

from specdraft.costs import CostCurve
from specdraft.decoding import generate
from specdraft.drafters import DraftModelDrafter, PromptLookupDrafter
from specdraft.drafters.base import Draft, NoDrafter
from specdraft.sampling import SamplingConfig
from specdraft.sequence import GenerationConfig, speculation_policy
from specdraft.speculation import AdaptivePolicy, FixedPolicy, Line, depth_key, sequential_stop
from specdraft.verification import VerifyResult
from toys import PatternDrafter, hf_target, random_bigram

PROMPT = [5, 9, 3, 17, 9, 3, 22, 40]


def _curve(per_token: float, step: float = 0.01) -> CostCurve:
    """A forward costs ``step`` plus ``per_token`` x step for every new token beyond the first."""
    sizes = (1, 2, 4, 8, 16)
    row = tuple(step * (1 + per_token * (size - 1)) for size in sizes)
    return CostCurve(sizes, (64,), (row,), {"name": "toy"}, {"cpu": "toy"})


def _chain(confidence: list[float]) -> Draft:
    return Draft(torch.arange(len(confidence)), confidence=torch.tensor(confidence))


def test_cost_curve_interpolates_and_extrapolates() -> None:
    curve = _curve(0.5)
    assert curve.seconds(1) == pytest.approx(0.01)
    assert curve.seconds(3) == pytest.approx(0.02)  # between the measured sizes 2 and 4
    assert curve.seconds(32) == pytest.approx(0.01 * (1 + 0.5 * 31))  # the last slope, beyond 16
    assert curve.ratios()[-1] == pytest.approx(8.5)
    assert CostCurve.from_dict(curve.to_dict()) == curve


def test_long_contexts_are_priced_by_their_own_row() -> None:
    """Attention over a long cache makes each extra new token dearer: the policy drafts less there."""
    sizes, step = (1, 2, 4, 8), 0.01
    rows = tuple(tuple(step * (1 + per * (size - 1)) for size in sizes) for per in (0.05, 0.1, 0.9))
    curve = CostCurve(sizes, (64, 512, 2048), rows, {"name": "toy"}, {"cpu": "toy"})
    assert curve.seconds(2, 1280) == pytest.approx(step * (1 + 0.5 * (0.1 + 0.9)))  # between 512 and 2048
    assert curve.seconds(2, 3584) == pytest.approx(step * (1 + 0.9 + 0.8))  # beyond 2048, along the last slope
    policy = AdaptivePolicy(curve, 6)
    for _ in range(60):  # every depth accepted 70% of the time
        for depth in range(1, 7):
            policy.acceptance.update(depth_key(depth, None), depth <= 2 or _ % 10 < 7)
    short, long = policy.budget(100, 6), policy.budget(2000, 6)
    assert short >= 3 and long < short


def test_draft_kinds_are_priced_apart() -> None:
    """Copy steps that cost nothing to draft and are right, and model steps that cost a forward a token and are
    wrong: pooled, the copies would pay for the chains; per kind, only the copies are drafted."""
    policy = AdaptivePolicy(_curve(0.2), 4)
    for step in range(40):
        kind = "copy" if step % 2 else "model"
        depth = policy.budget(100, 4, kind)
        if depth == 0:
            continue
        draft = Draft(torch.arange(depth), source=torch.full((depth,), 13 if kind == "copy" else 0))
        accepted = depth if kind == "copy" else 0
        result = VerifyResult(num_draft_tokens=depth, num_accepted=accepted, next_token=0)
        policy.observe(draft, result, 0.0 if kind == "copy" else 0.008 * depth, 0.01)
    assert policy.budget(100, 4, "copy") >= 3
    assert policy.budget(100, 4, "model") == 0
    assert policy._drafting_seconds(policy.kinds["model"], 2) > policy._drafting_seconds(policy.kinds["copy"], 2) == 0


def test_a_draft_models_catch_up_forward_is_priced_per_step_not_per_token() -> None:
    """A draft model's first forward of a step reads the tokens committed since it last drafted, so a 1-token draft
    costs about what a 3-token one does: learned as a cost per step (and the fresh read of a new prompt not learned
    at all), the policy drafts deeper than when the same seconds are priced per token."""
    from specdraft.drafters.base import CatchUp

    def learn(with_record: bool) -> AdaptivePolicy:
        policy = AdaptivePolicy(_curve(0.05), 4)
        for depth in range(1, 5):  # every depth accepted 80% of the time
            for trial in range(40):
                policy.acceptance.update(depth_key(depth, "model"), trial % 5 != 0)
        for _ in range(40):
            policy.budget(100, 1, "model")  # 1-token drafts only, each 8 ms: a 7 ms catch-up and 1 ms of drafting
            if with_record:
                policy.note_catch_up(CatchUp(0.0, 0.007, fresh=False))
            draft = Draft(torch.arange(1), source=torch.zeros(1, dtype=torch.long))
            policy.observe(draft, VerifyResult(1, 1, 0), 0.008, 0.0105)
        return policy

    apart, pooled = learn(True), learn(False)
    assert apart.kinds["model"].catch_up.intercept == pytest.approx(0.007, rel=0.05)
    assert apart.kinds["model"].draft_seconds_per_token == pytest.approx(0.001, rel=0.05)
    assert pooled.kinds["model"].draft_seconds_per_token == pytest.approx(0.008, rel=0.05)
    assert apart.budget(100, 4, "model") > pooled.budget(100, 4, "model")
    fresh = AdaptivePolicy(_curve(0.05), 4)
    fresh.budget(100, 1, "model")
    fresh.note_catch_up(CatchUp(0.0, 0.077, fresh=True))  # a new sequence's prompt, read by the first forward
    fresh.observe(Draft(torch.arange(1), source=torch.zeros(1, dtype=torch.long)), VerifyResult(1, 1, 0), 0.078, 0.01)
    assert fresh.kinds["model"].catch_up.intercept == 0.0
    assert fresh.kinds["model"].draft_seconds_per_token == pytest.approx(0.0001)


def test_the_tokens_a_catch_up_reads_are_not_priced_into_the_next_draft() -> None:
    """A catch-up forward that read the tokens of a run of plain steps costs more than one that read a token; those
    tokens are read whenever the model drafts next, so the policy prices a drafting step at the line's one-token
    cost (here 2 ms + 0.5 ms a further token), not at the average catch-up (about 4.5 ms), and drafts where that
    pays."""
    from specdraft.drafters.base import CatchUp

    policy = AdaptivePolicy(_curve(0.05), 4)
    for depth in range(1, 5):  # the model's drafts accepted 45% of the time at every depth
        for trial in range(40):
            policy.acceptance.update(depth_key(depth, "model"), trial % 20 < 9)
    for read in [1, 9, 3, 12, 1, 7, 5, 10] * 5:
        policy.budget(100, 1, "model")
        policy.note_catch_up(CatchUp(0.0, 0.002 + 0.0005 * (read - 1), fresh=False, tokens=read))
        policy.observe(Draft(torch.arange(1), source=torch.zeros(1, dtype=torch.long)), VerifyResult(1, 0, 0),
                       0.002 + 0.0005 * (read - 1), 0.0105)
    state = policy.kinds["model"]
    assert state.catch_up.intercept == pytest.approx(0.002, rel=0.02)
    assert state.catch_up.slope == pytest.approx(0.0005, rel=0.02)
    assert policy.budget(100, 4, "model") > 0
    averaged = AdaptivePolicy(_curve(0.05), 4)  # the same reads, each priced whole: drafting never pays
    averaged.acceptance = policy.acceptance
    averaged.kinds["model"] = replace(state, catch_up=Line(0.0045, 0.0))
    assert averaged.budget(100, 4, "model") == 0


def test_drafting_is_priced_by_a_line_in_the_depth() -> None:
    """A draft model's first token comes with its catch-up forward and each further one costs a forward: drafting
    beyond the catch-up is 0.3 ms + 1.4 ms a token after the first. Priced per token on average, mostly 1-token
    drafts make a 1-token draft look dearer and a 3-token one cheaper than they are; the line prices both."""
    policy = AdaptivePolicy(_curve(0.05), 4)
    for depth in range(1, 5):  # drafts that are always right: the policy drafts as deep as it is allowed
        for _ in range(40):
            policy.acceptance.update(depth_key(depth, "model"), True)
    for step in range(60):
        depth = 2 if step % 5 == 0 else 1
        assert policy.budget(100, depth, "model") == depth
        draft = Draft(torch.arange(depth), source=torch.zeros(depth, dtype=torch.long))
        policy.observe(draft, VerifyResult(depth, 0, 0), 0.0003 + 0.0014 * (depth - 1), 0.0105)
    state = policy.kinds["model"]
    assert policy._drafting_seconds(state, 1) == pytest.approx(0.0003, rel=0.02)
    assert policy._drafting_seconds(state, 3) == pytest.approx(0.0031, rel=0.02)
    assert state.draft_seconds_per_token > 1.1 * 0.0003 and 3 * state.draft_seconds_per_token < 0.5 * 0.0031  # average


def test_the_verify_slope_is_learned_apart_from_the_scale() -> None:
    """A machine whose plain step costs 1.5x the curve's but whose extra tokens cost half the curve's extra: the
    scale follows the plain steps, the slope the verifies, and the prices of both match what was measured."""
    curve = _curve(0.3)
    policy = AdaptivePolicy(curve, 4)

    def measured(tokens: int) -> float:
        return 1.5 * (curve.seconds(1, 100) + 0.5 * (curve.seconds(tokens, 100) - curve.seconds(1, 100)))

    for step in range(1000):  # the two estimates depend on each other: some hundreds of steps to settle
        depth = step % 4  # plain steps and verifies of 1 to 3 draft tokens
        policy.budget(100, depth, "model")
        draft = Draft(torch.arange(depth), source=torch.zeros(depth, dtype=torch.long))
        policy.observe(draft, VerifyResult(depth, 0, 0), 0.0, measured(1 + depth))
    assert policy.verify_scale == pytest.approx(1.5, rel=0.02)
    assert policy.verify_slope == pytest.approx(0.5, rel=0.05)
    for tokens in (1, 2, 4):
        assert policy._verify_seconds(tokens, 100) == pytest.approx(measured(tokens), rel=0.02)


def test_a_draft_model_records_its_catch_up_forward() -> None:
    """The chain's first forward is recorded (and found through a combination), fresh when it read a new sequence's
    prompt (the whole context, or all of it past a prefix the last sequence shared); a step that drafts nothing from
    the model records nothing new."""
    import time

    from specdraft.drafters.base import catch_up
    from specdraft.drafters.combined import WithPromptLookup

    drafter = WithPromptLookup(DraftModelDrafter(hf_target(seed=1)), PromptLookupDrafter(3, 1))
    start = time.perf_counter()
    drafter.propose(torch.tensor(PROMPT), 3, SamplingConfig(), None)
    first = catch_up(drafter, start)
    assert first is not None and first.fresh and first.seconds > 0 and first.tokens == len(PROMPT)  # read it all
    later = time.perf_counter()
    drafter.propose(torch.tensor(PROMPT + [7, 8]), 3, SamplingConfig(), None)
    second = catch_up(drafter, later)
    assert second is not None and not second.fresh and second.tokens in (1, 2)  # the new tokens its cache lacks
    assert catch_up(drafter, time.perf_counter()) is None
    drafter.begin(hf_target(seed=1), None)  # a new sequence whose prompt starts as the last one's (a chat template)
    again = time.perf_counter()
    drafter.propose(torch.tensor(PROMPT[:2] + [9, 10, 11]), 3, SamplingConfig(), None)
    third = catch_up(drafter, again)
    assert third is not None and third.fresh  # its prompt's read is prefill, not a catch-up to price
    later = time.perf_counter()
    drafter.propose(torch.tensor(PROMPT[:2] + [9, 10, 11, 12]), 3, SamplingConfig(), None)
    assert not catch_up(drafter, later).fresh


def test_auxiliary_tokens_a_kind_feeds_are_priced_before_drafting() -> None:
    """A drafter whose drafts also feed 15 auxiliary tokens (Lookahead's window) at a verify cost of 0.1 step a
    token: once the policy has seen them, budget prices the window with the nodes and a 2-node draft accepted half
    the time stops paying; priced by its nodes alone it still looked worth drafting."""
    from specdraft.trees import AuxBranch

    aux = AuxBranch(torch.arange(15), torch.arange(1, 16), torch.ones(15, 15, dtype=torch.bool).tril())
    policy = AdaptivePolicy(_curve(0.1), 4)
    assert policy.budget(100, 4, "window") > 0
    for step in range(60):
        depth = policy.budget(100, 4, "window")
        if depth == 0:
            continue
        draft = Draft(torch.arange(depth), source=torch.full((depth,), 3), aux=aux)
        accepted = int(step % 2 == 0)
        result = VerifyResult(num_draft_tokens=depth, num_accepted=accepted, next_token=0)
        policy.observe(draft, result, 0.0, 0.01 * (1 + 0.1 * (depth + 15)))
    state = policy.kinds["window"]
    assert 2 < state.aux_tokens <= 15  # learned from the steps it drafted, until it stopped drafting
    assert policy.verify_scale == pytest.approx(1.0)  # each verify as the curve prices every token it fed
    state.plain_run = 0  # no exploration step in the two calls below
    assert policy.budget(100, 4, "window") == 0
    state.aux_tokens, state.plain_run = 0.0, 0  # the same acceptance without the window: drafting pays
    assert policy.budget(100, 4, "window") > 0


def test_a_dear_exploring_step_waits_until_its_excess_is_a_small_share_of_the_time() -> None:
    """Drafts that never pay: a 1-token draft step still comes, every 8th step at the soonest, and no sooner than
    where what it costs beyond a plain step is 2% of the run's time: on this curve a chain's costs 1.1 plain steps
    (every 8th), one that also feeds a 15-token window 2.6 (every 78th: 1.6 / (77 + 2.6) = 2%)."""
    plain_runs = {}
    for kind, window in (("chain", 0.0), ("window", 15.0)):
        policy = AdaptivePolicy(_curve(0.1), 4)
        for depth in range(1, 5):
            policy.acceptance.counts[depth_key(depth, kind)] = [0.0, 150.0]
        policy._state(kind).aux_tokens = window
        calls = [policy.budget(100, 4, kind) for _ in range(200)]
        plain_runs[kind] = calls.index(1) + 1
        assert calls[plain_runs[kind]:].index(1) + 1 == plain_runs[kind]  # and again as many steps later
    assert plain_runs == {"chain": 8, "window": 78}


def test_free_verification_and_sure_drafts_verify_everything() -> None:
    policy = AdaptivePolicy(_curve(0.0), 5)
    assert policy.budget(100, 10) == 5 and policy.budget(100, 3) == 3
    draft = _chain([0.95] * 5)
    assert len(policy.trim(draft, 100, 1, 0.0, greedy=True)) == 5


def test_verification_as_dear_as_steps_means_plain_steps() -> None:
    """When k tokens cost k steps no draft can pay: the policy proposes nothing, and trims a draft to nothing."""
    policy = AdaptivePolicy(_curve(1.0), 5)
    assert len(policy.trim(_chain([0.5] * 4), 100, 1, 0.0, greedy=True)) == 0
    for _ in range(20):  # unsure drafts at every depth, all rejected
        policy.budget(100, 5)
        policy.observe(_chain([0.5]), VerifyResult(1, 0, 7), 0.001, 0.02)
    assert policy.budget(100, 5) == 0


def test_trim_keeps_the_confident_prefix() -> None:
    policy = AdaptivePolicy(_curve(0.3), 6)
    trimmed = policy.trim(_chain([0.99, 0.98, 0.97, 0.15, 0.9, 0.9]), 100, 1, 0.0, greedy=True)
    assert trimmed.tokens.tolist() == [0, 1, 2] and trimmed.confidence.shape == (3,)


def test_tree_trim_keeps_an_ancestor_closed_subset() -> None:
    parents = torch.tensor([-1, 0, -1, 1, 2])
    draft = Draft(torch.arange(5), parents=parents, confidence=torch.tensor([0.95, 0.9, 0.05, 0.9, 0.9]))
    trimmed = AdaptivePolicy(_curve(0.3), 4).trim(draft, 100, 1, 0.0, greedy=True)
    assert trimmed.tokens.tolist() == [0, 1, 3] and trimmed.parents.tolist() == [-1, 0, 1]


def test_acceptance_is_learned_per_source() -> None:
    """A copy kind that is always right and one that is always wrong end up far apart."""
    policy = AdaptivePolicy(_curve(0.2), 4)
    verify = policy.costs.seconds(4)  # each 3-token verify measured as the curve prices it
    for _ in range(50):
        good = Draft(torch.arange(3), source=torch.full((3,), 3))
        policy.observe(good, VerifyResult(3, 3, 9), 0.0, verify)
        bad = Draft(torch.arange(3), source=torch.full((3,), 1))
        policy.observe(bad, VerifyResult(3, 0, 9), 0.0, verify)
    assert policy.acceptance.rate((3, "depth", 2)) > 0.95 > 0.05 > policy.acceptance.rate((1, "depth", 1))
    assert len(policy.trim(Draft(torch.arange(3), source=torch.full((3,), 3)), 100, 1, 0.0, True)) == 3
    assert len(policy.trim(Draft(torch.arange(3), source=torch.full((3,), 1)), 100, 1, 0.0, True)) == 0


def test_sequential_stop_never_looks_at_the_node_it_decides_on() -> None:
    """Keeping node i+1 may depend on what is known before it is drawn (reach[i] uses its parent's row), never on
    anything later: changing later values cannot change an earlier decision."""
    def rate(size, expected):
        return expected / (1.0 + 0.4 * size)

    reach = [0.9, 0.8, 0.3, 0.25]
    stop = sequential_stop(reach, rate)
    for later in ([0.9, 0.8, 0.3, 0.29], [0.9, 0.8, 0.3, 0.0001]):
        assert sequential_stop(later, rate) >= min(stop, 3)
    assert sequential_stop([0.99] * 4, rate) == 4 and sequential_stop([0.01] * 4, rate) == 0


@pytest.mark.parametrize("pattern", ["always", "sometimes", "never"])
def test_adaptive_greedy_equals_plain_with_a_persistent_policy(pattern: str) -> None:
    target = hf_target(0)
    plain = generate(target, PROMPT, None, GenerationConfig(40)).token_ids
    rules = {"always": lambda s, i: False, "sometimes": lambda s, i: (s * 7 + i * 3) % 5 == 0,
             "never": lambda s, i: i == 0}
    policy = AdaptivePolicy(_curve(0.15), 5)
    for _ in range(3):
        result = generate(target, PROMPT, PatternDrafter(target, rules[pattern]), GenerationConfig(40, 5),
                          policy=policy)
        assert result.token_ids == plain
    if pattern == "never":  # it learned that drafting does not pay and mostly stopped proposing
        assert result.stats.draft_tokens_proposed < 40 / 3


def test_the_policy_is_chosen_from_the_config_and_measures_the_target_once() -> None:
    target, drafter = hf_target(0), PromptLookupDrafter()
    fixed = speculation_policy(GenerationConfig(num_draft_tokens=4, speculation="fixed"), target, drafter)
    assert isinstance(fixed, FixedPolicy) and fixed.num_draft_tokens == 4
    assert speculation_policy(GenerationConfig(), target, None).budget(100, 8) == 0  # no drafter: plain steps
    assert speculation_policy(GenerationConfig(), target, NoDrafter()).budget(100, 8) == 0
    policy = speculation_policy(GenerationConfig(num_draft_tokens=4, max_draft_batch=2), target, drafter)
    assert isinstance(policy, AdaptivePolicy) and policy.max_draft_tokens == 4 and policy.max_sequences == 2
    assert policy.costs is speculation_policy(GenerationConfig(), target, drafter).costs  # remembered, not remeasured
    assert all(math.isfinite(s) and s > 0 for row in policy.costs.table for s in row)


def test_a_batch_that_fills_the_machine_stops_drafting() -> None:
    """A step of n sequences is priced as n rows of the verify forward: where a 1-row forward leaves idle compute
    (extra tokens nearly free) drafting pays alone, and where n rows already fill it (each token costs its share)
    the same acceptance does not pay; the policy stops drafting at that batch size by itself."""
    sizes = (1, 2, 4, 8, 16, 32)
    curve = CostCurve(sizes, (64,), (tuple(0.01 * max(1.0, size / 4) for size in sizes),), {"name": "toy"},
                      {"cpu": "toy"})  # flat up to 4 new tokens, then linear
    policy = AdaptivePolicy(curve, 3)
    for _ in range(40):  # every depth accepted 80% of the time
        for depth in range(1, 4):
            policy.acceptance.update(depth_key(depth, None), _ % 5 != 0)
    assert policy.budget(100, 3, sequences=1) == 3
    assert policy.budget(100, 3, sequences=8) == 0
    assert len(policy.trim(_chain([0.9] * 3), 100, 1, 0.0, True, sequences=8)) == 0
    assert len(policy.trim(_chain([0.9] * 3), 100, 1, 0.0, True, sequences=1)) == 3
    capped = AdaptivePolicy(curve, 3, max_sequences=2)  # a fixed cut, as vLLM's speculative_disable_by_batch_size
    capped.acceptance = policy.acceptance
    assert capped.budget(100, 3, sequences=2) > 0 and capped.budget(100, 3, sequences=3) == 0
    assert FixedPolicy(3, max_sequences=2).budget(100, 5, sequences=3) == 0
    assert FixedPolicy(3).budget(100, 5, sequences=64) == 3


def test_the_verify_scale_is_learned_from_the_whole_batch_forward() -> None:
    """In a batch the loop reports the seconds of the whole forward; the policy compares them with the curve's price
    of the whole forward (every row as wide as its own), so a batch step measured as predicted leaves the scale."""
    policy = AdaptivePolicy(_curve(0.5), 3)
    for _ in range(30):
        depth = policy.budget(100, 3, sequences=4)
        draft = _chain([0.9] * depth)
        policy.observe(draft, VerifyResult(depth, depth, 0), 0.0, policy.costs.seconds(4 * (1 + depth), 100))
    assert policy.verify_scale == pytest.approx(1.0)


@pytest.mark.parametrize("drafter_kind", ["draft-model", "prompt-lookup"])
def test_adaptive_sampling_distribution_chi_square(drafter_kind: str) -> None:
    """With a policy that cuts drafts by their confidence (a steep cost curve) and learns as it goes, speculative
    samples still follow the target's distribution (chi-square over all 3-token continuations, p > 1e-3)."""
    target, draft = random_bigram(5, seed=0), random_bigram(5, seed=1)
    prompt = [0, 1, 2, 0, 1, 2, 0]
    drafter = DraftModelDrafter(draft) if drafter_kind == "draft-model" else PromptLookupDrafter()
    sampling, runs = SamplingConfig(1.0), 4000
    generator, policy = torch.Generator().manual_seed(99), AdaptivePolicy(_curve(0.35), 3)
    config = GenerationConfig(3, 3, sampling)
    counts = Counter(tuple(generate(target, prompt, drafter, config, generator, policy=policy).token_ids)
                     for _ in range(runs))
    probs = torch.softmax(target.table, -1)
    exact = {}
    for seq in counts.keys() | {(a, b, c) for a in range(5) for b in range(5) for c in range(5)}:
        exact[seq] = float(probs[prompt[-1], seq[0]] * probs[seq[0], seq[1]] * probs[seq[1], seq[2]])
    cells = [seq for seq, p in exact.items() if p * runs >= 5]
    observed = [counts[s] for s in cells] + [runs - sum(counts[s] for s in cells)]
    expected = [exact[s] * runs for s in cells] + [runs - sum(exact[s] * runs for s in cells)]
    assert chisquare(observed, expected).pvalue > 1e-3
