"""Batched speculative decoding: every row equals batch-1 decoding (greedy, token for token, fp32), each row
samples from the target's distribution, ragged acceptance, sequences joining and leaving between steps."""

import itertools
from collections import Counter

import pytest
import torch

from specdraft.batching import BatchDecoder, DraftGate, generate_batch
from specdraft.decoding import GenerationConfig, generate
from specdraft.drafters import DraftModelDrafter, PromptLookupDrafter, WithPromptLookup
from specdraft.errors import SpecdraftError
from specdraft.models.native_llama import NativeLlama
from specdraft.sampling import SamplingConfig
from toys import PatternDrafter, assert_follows, hf_target, second_token_marginal, tiny_llama

PROMPTS = [[5, 9, 3, 17, 9, 3, 22, 40], [7], [11, 12, 13, 11, 12], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]]


@pytest.fixture(scope="module")
def target():
    return NativeLlama.from_hf(tiny_llama(0))


@pytest.fixture(scope="module")
def drafter_model():
    return NativeLlama.from_hf(tiny_llama(1))


def _alone(target, prompt, drafter, config):
    return generate(target, prompt, drafter, config).token_ids


@pytest.mark.parametrize("kind", ["plain", "draft-model", "prompt-lookup", "pattern", "tree"])
def test_every_row_equals_batch_one_greedy(target, drafter_model, kind):
    offsets = itertools.count()  # each row's pattern drafter is wrong at different steps: ragged acceptance

    def pattern():
        offset = next(offsets)
        return PatternDrafter(target, lambda step, i: ((step + offset) * 7 + i * 3) % 5 == 0)

    makers = {
        "plain": lambda: None,
        "draft-model": lambda: DraftModelDrafter(drafter_model),
        "prompt-lookup": PromptLookupDrafter,
        "pattern": pattern,
        "tree": lambda: DraftModelDrafter(drafter_model, tree_branching=2, tree_nodes=6),
    }
    config = GenerationConfig(30, 3)
    expected = [_alone(target, p, makers[kind](), config) for p in PROMPTS]
    offsets = itertools.count()
    results = generate_batch(target, PROMPTS, makers[kind], config)
    assert [r.token_ids for r in results] == expected
    if kind == "pattern":  # ragged: rows accepted different numbers of tokens in the same steps
        assert len({tuple(r.stats.accept_lengths) for r in results}) > 1


def test_rows_join_and_leave_between_steps(target, drafter_model):
    """More prompts than rows, different lengths and max_new_tokens: finished rows are refilled."""
    prompts = PROMPTS * 2
    config = GenerationConfig(17, 4)
    expected = [_alone(target, p, DraftModelDrafter(drafter_model), config) for p in prompts]
    results = generate_batch(target, prompts, lambda: DraftModelDrafter(drafter_model), config, batch_size=3)
    assert [r.token_ids for r in results] == expected


def test_drafting_stops_above_max_draft_batch_and_output_is_unchanged(target, drafter_model):
    config = GenerationConfig(20, 3)
    expected = [_alone(target, p, None, config) for p in PROMPTS]
    make = lambda: DraftModelDrafter(drafter_model)  # noqa: E731
    full = generate_batch(target, PROMPTS, make, config, max_draft_batch=3)  # 4 rows, then 3, 2, 1 as they end
    assert [r.token_ids for r in full] == expected
    never = generate_batch(target, PROMPTS, make, config, max_draft_batch=1, batch_size=4)
    assert [r.token_ids for r in never] == expected
    drafted = [r.stats.draft_tokens_proposed for r in never]
    assert sum(drafted) < sum(r.stats.draft_tokens_proposed for r in generate_batch(target, PROMPTS, make, config))
    with pytest.raises(SpecdraftError, match="max_draft_batch"):
        BatchDecoder(target, 2, 64, max_draft_batch=-1)


def test_decoder_with_per_sequence_settings_and_eos(target):
    decoder = BatchDecoder(target, max_batch=4, capacity=128)
    plain = _alone(target, PROMPTS[0], None, GenerationConfig(20))
    eos = plain[6]
    configs = [GenerationConfig(20, 2), GenerationConfig(5, 4), GenerationConfig(20, 3, eos_token_ids=(eos,))]
    seqs = [decoder.add(PROMPTS[0], PromptLookupDrafter(), c) for c in configs]
    streamed = {id(s): [] for s in seqs}
    while decoder.rows:
        for seq, tokens in decoder.step():
            streamed[id(seq)] += tokens
    assert seqs[0].generated == plain and streamed[id(seqs[0])] == plain
    assert seqs[1].generated == plain[:5] and seqs[1].finish_reason == "length"
    assert seqs[2].generated == plain[: plain.index(eos) + 1] and seqs[2].finish_reason == "eos"
    assert decoder.free_rows == 4


def test_removed_sequence_leaves_the_others_unchanged(target):
    decoder = BatchDecoder(target, max_batch=3, capacity=128)
    config = GenerationConfig(24, 3)
    seqs = [decoder.add(p, PromptLookupDrafter(), config) for p in PROMPTS[:3]]
    decoder.step()
    decoder.remove(seqs[0])  # a client that went away: the last row moves into its place
    while decoder.rows:
        decoder.step()
    for seq, prompt in zip(seqs[1:], PROMPTS[1:3], strict=True):
        assert seq.generated == _alone(target, prompt, PromptLookupDrafter(), config)


@pytest.mark.parametrize("drafter_kind", ["plain", "draft-model"])
def test_sampling_distribution_per_row(drafter_kind):
    """Second generated token of each row, over seeded generations, follows the exact marginal (chi-square)."""
    model = tiny_llama(0, vocab_size=16, std=0.1)
    target = NativeLlama.from_hf(model)
    sampling = SamplingConfig(temperature=1.0)
    prompts = [[3, 5, 7], [9, 2]]
    draft = NativeLlama.from_hf(tiny_llama(1, vocab_size=16, std=0.1))
    trials = 600
    counts = [Counter(), Counter()]
    for seed in range(trials // 4):
        gens = [torch.Generator().manual_seed(1000 * seed + j) for j in range(4)]
        make = (lambda: None) if drafter_kind == "plain" else (lambda: DraftModelDrafter(draft))
        results = generate_batch(target, prompts * 2, make, GenerationConfig(3, 2, sampling), gens)
        for j, result in enumerate(results):
            counts[j % 2][result.token_ids[1]] += 1
    for row, prompt in enumerate(prompts):
        assert_follows(counts[row], second_token_marginal(model, prompt, sampling), trials // 2)


def test_bad_inputs_are_clear_errors(target):
    with pytest.raises(SpecdraftError, match="native Llama"):
        BatchDecoder(hf_target(0), 2, 64)
    decoder = BatchDecoder(target, max_batch=1, capacity=32)
    with pytest.raises(SpecdraftError, match="prompt too long"):
        decoder.add(list(range(1, 30)), None, GenerationConfig(10))
    with pytest.raises(SpecdraftError, match="empty prompt"):
        decoder.add([], None, GenerationConfig(10))
    decoder.add([1, 2], None, GenerationConfig(10))
    with pytest.raises(SpecdraftError, match="full"):
        decoder.add([1, 2], None, GenerationConfig(10))


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0)])
def test_lockstep_drafting_equals_one_drafter_at_a_time(target, drafter_model, sampling):
    """Draft models batched across rows (threads in lockstep) propose what each would alone: same drafts, so the
    same output and the same accept lengths as drafting one sequence after another."""
    from specdraft.batch_drafting import lockstep_factory
    from specdraft.batching import drafter_factory

    prototype = WithPromptLookup(DraftModelDrafter(drafter_model, confidence_threshold=0.2), PromptLookupDrafter(2))
    config = GenerationConfig(25, 3, sampling)
    prompts = PROMPTS * 2

    def run(make):
        generators = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
        return generate_batch(target, prompts, make, config, generators, batch_size=5)

    alone = run(drafter_factory(prototype))
    together = run(lockstep_factory(prototype, 12, 128, drafter_factory(prototype)))
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [r.stats.accept_lengths for r in together] == [r.stats.accept_lengths for r in alone]
    assert sum(r.stats.draft_tokens_accepted for r in together) > 0


def test_draft_gate_tries_both_then_keeps_the_faster_and_explores():
    gate = DraftGate(explore_every=4)
    assert gate.drafting(1)  # one sequence: always (its own policy sizes the draft)
    assert gate.drafting(3)  # untried: draft first
    gate.record(3, True, tokens=6, seconds=1.0)
    assert not gate.drafting(3)  # then a plain step
    gate.record(3, False, tokens=9, seconds=1.0)
    choices = [gate.drafting(3) for _ in range(8)]
    assert choices.count(False) == 6 and choices.count(True) == 2  # plain is faster; drafting retried every 4th
    gate.record(3, True, tokens=30, seconds=1.0)  # drafting got faster: the moving average moves towards it
    gate.record(3, True, tokens=30, seconds=1.0)
    gate.record(3, True, tokens=30, seconds=1.0)
    assert gate.rates[(3, True)] > gate.rates[(3, False)] and gate.drafting(3)
    gate.record(1, True, tokens=5, seconds=1.0)
    assert (1, True) not in gate.rates


def test_gated_batch_output_is_unchanged(target, drafter_model):
    config = GenerationConfig(max_new_tokens=12, num_draft_tokens=3, speculation="fixed")
    make = lambda: DraftModelDrafter(drafter_model)  # noqa: E731
    plain = generate_batch(target, PROMPTS, None, config)
    decoder = BatchDecoder(target, 4, max(len(p) for p in PROMPTS) + 12, gate=DraftGate(explore_every=2))
    for i, prompt in enumerate(PROMPTS):
        decoder.add(prompt, make(), config).tag = i
    out = {}
    while decoder.rows:
        for seq, _ in decoder.step():
            if seq.finish_reason is not None:
                out[seq.tag] = seq.generated
    assert [out[i] for i in range(len(PROMPTS))] == [r.token_ids for r in plain]
    assert any(key[1] for key in decoder.gate.rates) and any(not key[1] for key in decoder.gate.rates)
