"""Batched speculative decoding: every row equals batch-1 decoding (greedy, token for token, fp32), each row
samples from the target's distribution, ragged acceptance, sequences joining and leaving between steps, and each
row's speculation policy deciding, at the batch size of each step, whether drafting pays."""

import itertools
from collections import Counter
from dataclasses import replace

import pytest
import torch

from specdraft.batching import BatchDecoder, BatchRows, generate_batch
from specdraft.costs import CostCurve
from specdraft.decoding import generate
from specdraft.drafters import DraftModelDrafter, PromptLookupDrafter, WithPromptLookup
from specdraft.errors import SpecdraftError
from specdraft.models.native_llama import NativeLlama
from specdraft.sampling import SamplingConfig
from specdraft.sequence import GenerationConfig
from specdraft.speculation import AdaptivePolicy, FixedPolicy
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
    config = GenerationConfig(30, 3, speculation="fixed")  # γ every step: ragged acceptance in every step
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
    config = GenerationConfig(20, 3, speculation="fixed")
    expected = [_alone(target, p, None, config) for p in PROMPTS]
    make = lambda: DraftModelDrafter(drafter_model)  # noqa: E731
    full = generate_batch(target, PROMPTS, make, replace(config, max_draft_batch=3))  # 4 rows, then 3, 2, 1
    assert [r.token_ids for r in full] == expected
    never = generate_batch(target, PROMPTS, make, replace(config, max_draft_batch=1), batch_size=4)
    assert [r.token_ids for r in never] == expected
    drafted = [r.stats.draft_tokens_proposed for r in never]
    assert sum(drafted) < sum(r.stats.draft_tokens_proposed for r in generate_batch(target, PROMPTS, make, config))
    with pytest.raises(SpecdraftError, match="max_draft_batch"):
        GenerationConfig(max_draft_batch=-1)


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
    """Second generated token of each row, over seeded generations, follows the exact marginal (chi-square). Fixed
    γ, so the seeded draws are the same in every run (adaptive lengths follow the machine's timings; their exactness
    is tested in test_speculation.py)."""
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
        results = generate_batch(target, prompts * 2, make, GenerationConfig(3, 2, sampling, speculation="fixed"), gens)
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
    config = GenerationConfig(25, 3, sampling, speculation="fixed")  # draft sizes that do not follow timings
    prompts = PROMPTS * 2

    def run(make):
        generators = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
        return generate_batch(target, prompts, make, config, generators, batch_size=5)

    alone = run(drafter_factory(prototype))
    together = run(lockstep_factory(prototype, 12, 128, drafter_factory(prototype)))
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [r.stats.accept_lengths for r in together] == [r.stats.accept_lengths for r in alone]
    assert sum(r.stats.draft_tokens_accepted for r in together) > 0


def _fills_at(rows: int) -> CostCurve:
    """A target whose forward costs one second up to ``rows`` new tokens and grows linearly beyond: extra tokens are
    free for one sequence, and a batch of ``rows`` sequences already fills the machine. (Seconds, so that the toy
    drafters' real drafting time is negligible beside it.)"""
    sizes = (1, 2, 4, 8, 16, 32)
    return CostCurve(sizes, (64,), (tuple(max(1.0, size / rows) for size in sizes),), {"name": "toy"}, {"cpu": "toy"})


def test_adaptive_speculation_switches_a_batchs_drafting_off_and_on(target, monkeypatch):
    """GenerationConfig.speculation (adaptive by default) in a batch: each sequence's policy is made from its config
    and priced at the number of sequences in each step. One sequence alone drafts; three more join and the batch
    fills the machine, so drafting stops (but for a rare exploring draft); they leave and it drafts again. Output
    equals batch-1 plain decoding throughout."""
    import specdraft.sequence

    monkeypatch.setattr(specdraft.sequence, "cost_curve", lambda model, log=None: _fills_at(4))  # not this machine's
    config = GenerationConfig(60, 3)
    pattern = lambda: PatternDrafter(target, lambda step, i: False)  # noqa: E731  (always right)
    decoder = BatchDecoder(target, 4, 128)
    drafted: dict[int, list[tuple[int, int]]] = {}  # id(sequence) -> (sequences in the step, draft size) per step
    decoder.on_verify = lambda seq, logits, missed, size: drafted.setdefault(id(seq), []).append(
        (len(decoder.rows), size))
    first = decoder.add(PROMPTS[0], pattern(), config)
    assert isinstance(first.policy, AdaptivePolicy)
    assert isinstance(decoder.add(PROMPTS[1], pattern(), replace(config, speculation="fixed")).policy, FixedPolicy)
    decoder.remove(decoder.rows[1])
    for _ in range(4):
        decoder.step()
    others = [decoder.add(p, pattern(), config) for p in PROMPTS[1:]]
    for _ in range(10):
        decoder.step()
    for seq in others:
        decoder.remove(seq)
    while decoder.rows:
        decoder.step()
    steps = drafted[id(first)]
    alone_before, batched, alone_after = steps[:4], steps[4:14], steps[14:]
    assert all(rows == 1 and size == 3 for rows, size in alone_before)  # alone: drafting pays
    assert all(rows == 4 for rows, _ in batched) and sum(size > 0 for _, size in batched) <= 2  # off (explores)
    assert len(alone_after) > 2 and all(rows == 1 for rows, _ in alone_after)
    assert sum(size > 0 for _, size in alone_after) >= len(alone_after) - 1  # on again (the last step may not)
    for seq in others:
        assert sum(size > 0 for _, size in drafted[id(seq)]) <= 2  # the sequences that joined never paid to draft
    assert first.generated == _alone(target, PROMPTS[0], None, config)


@pytest.fixture(scope="module")
def quantized_target():
    from specdraft.models.quantized_llama import QuantizedLlama

    return QuantizedLlama.from_dense(NativeLlama.from_hf(tiny_llama(0)), "int4")


@pytest.mark.parametrize("kind", ["draft-model", "pattern", "tree"])
def test_quantized_batched_verifies_equal_batched_plain_decoding(quantized_target, drafter_model, kind):
    """A quantized target (fp16 cache, block kernels) decoded in a batch: every row's speculative output equals the
    same batch decoded plainly, token for token; its verifies attend each query on its own as its plain steps do."""
    offsets = itertools.count()

    def pattern():
        offset = next(offsets)
        return PatternDrafter(quantized_target, lambda step, i: ((step + offset) * 7 + i * 3) % 5 == 0)

    makers = {
        "draft-model": lambda: DraftModelDrafter(drafter_model),
        "pattern": pattern,
        "tree": lambda: DraftModelDrafter(drafter_model, tree_branching=2, tree_nodes=6),
    }
    config = GenerationConfig(48, 4, speculation="fixed")
    plain = generate_batch(quantized_target, PROMPTS, lambda: None, config)
    speculative = generate_batch(quantized_target, PROMPTS, makers[kind], config)
    assert [r.token_ids for r in speculative] == [r.token_ids for r in plain]
    assert sum(r.stats.target_forward_calls for r in speculative) < sum(r.stats.target_forward_calls for r in plain)


@pytest.mark.parametrize("kind", ["plain", "draft-model", "tree"])
def test_quantized_batched_rows_equal_batch_one_decoding(quantized_target, drafter_model, kind):
    """A block-quantized target decoded in a batch gives every row the tokens its batch-1 decoding gives, bit for
    bit: prompts longer than one prefill chunk of 64 tokens, ragged lengths, rows joining as others finish, and
    speculation (chains and trees) on the rows."""
    torch.manual_seed(3)
    prompts = [*PROMPTS, torch.randint(3, 64, (150,)).tolist(), torch.randint(3, 64, (70,)).tolist()]
    makers = {
        "plain": lambda: None,
        "draft-model": lambda: DraftModelDrafter(drafter_model),
        "tree": lambda: DraftModelDrafter(drafter_model, tree_branching=2, tree_nodes=6),
    }
    config = GenerationConfig(40, 4, speculation="fixed")
    batched = generate_batch(quantized_target, prompts, makers[kind], config, batch_size=4)
    alone = [generate(quantized_target, prompt, makers[kind](), config).token_ids for prompt in prompts]
    assert [r.token_ids for r in batched] == alone


def _until_done(decoder, *seqs):
    while any(seq.finish_reason is None for seq in seqs):
        decoder.step()
    return [seq.generated for seq in seqs]


@pytest.mark.parametrize("kind", ["plain", "draft-model", "tree"])
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.8, top_k=20)])
def test_batched_prompts_read_what_running_and_finished_rows_hold_and_answers_stay_the_same(
        quantized_target, drafter_model, kind, sampling):
    """Prefix caching in batched decoding: a conversation's next turn reads its first turn and answer from the row
    that turn left (free, kept), a prompt sharing a running row's start copies those positions, an unrelated prompt
    takes the free row kept longest ago; every answer equals fresh batch-1 decoding's, greedy and sampled."""
    makers = {
        "plain": lambda: None,
        "draft-model": lambda: DraftModelDrafter(drafter_model),
        "tree": lambda: DraftModelDrafter(drafter_model, tree_branching=2, tree_nodes=6),
    }
    make = makers[kind]
    config = GenerationConfig(20, 3, sampling, speculation="fixed")
    torch.manual_seed(5)
    first = torch.randint(3, 64, (70,)).tolist()  # longer than one prefill chunk
    decoder = BatchDecoder(quantized_target, 3, 160)
    assert decoder.reuse
    seed = itertools.count()

    def add(prompt):
        return decoder.add(prompt, make(), config, torch.Generator().manual_seed(next(seed)))

    def fresh(prompt, i):
        return generate(quantized_target, prompt, make(), config, torch.Generator().manual_seed(i)).token_ids

    a = add(first)
    (answer,) = _until_done(decoder, a)
    second = first + answer + [7, 8, 9]
    b = add(second)  # the free row a left holds first + answer (but for its last token or so)
    assert len(first) + len(answer) - 1 <= b.stats.prompt_tokens_cached <= len(first) + len(answer)
    c = add([60, 61, 62] + first)  # shares nothing: the oldest free row
    d = add(first[:30] + [50, 51])  # b is running: its first 30 positions are copied
    assert (c.stats.prompt_tokens_cached, d.stats.prompt_tokens_cached) == (0, 30)
    answers = _until_done(decoder, b, c, d)
    e = add(second)  # b's row, free again, still holds it
    assert e.stats.prompt_tokens_cached == len(second) - 1
    answers += _until_done(decoder, e)
    prompts = [first, second, [60, 61, 62] + first, first[:30] + [50, 51], second]
    assert [answer, *answers] == [fresh(p, i) for i, p in enumerate(prompts)]
    assert a.stats.prompt_tokens_cached == 0


def test_batched_prefix_caching_is_off_where_reads_would_not_be_exact_or_when_asked(target, quantized_target):
    prompt = PROMPTS[3]
    for decoder in (BatchDecoder(target, 2, 64), BatchDecoder(quantized_target, 2, 64, prefix_cache=False)):
        assert not decoder.reuse
        first = decoder.add(prompt, None, GenerationConfig(6))
        _until_done(decoder, first)
        again = decoder.add(prompt, None, GenerationConfig(6))
        assert again.stats.prompt_tokens_cached == 0 and _until_done(decoder, again) == [first.generated]


def test_a_row_removed_without_keeping_or_failing_to_prefill_is_never_read(quantized_target, monkeypatch):
    prompt = PROMPTS[3]
    decoder = BatchDecoder(quantized_target, 2, 64)
    seq = decoder.add(prompt, None, GenerationConfig(4))
    decoder.step()
    decoder.remove(seq, keep=False)  # a step that raised may have left its keys half written
    assert decoder.add(prompt, None, GenerationConfig(4)).stats.prompt_tokens_cached == 0
    broken = decoder.add(prompt + [4, 5], None, GenerationConfig(4))
    assert broken.stats.prompt_tokens_cached == len(prompt) - 1  # read from the running row
    _until_done(decoder, *decoder.rows)
    monkeypatch.setattr(BatchRows, "prefill", lambda *a: (_ for _ in ()).throw(RuntimeError("broken")))
    other = [30, 31, 32, 40, 41, 42]
    with pytest.raises(RuntimeError, match="broken"):
        decoder.add(prompt[:3] + other, None, GenerationConfig(4))  # reads 3 positions, fails to feed the rest
    assert not decoder.rows and decoder.cache.lengths[0] == 0  # the failed row keeps nothing
    monkeypatch.undo()
    again = decoder.add(prompt[:3] + other, None, GenerationConfig(4))
    expected = generate(quantized_target, prompt[:3] + other, None, GenerationConfig(4)).token_ids
    assert _until_done(decoder, again) == [expected]


def test_an_unrelated_prompt_moves_a_kept_cache_to_an_empty_row_rather_than_dropping_it(quantized_target):
    decoder = BatchDecoder(quantized_target, 3, 64)
    first = PROMPTS[3]
    (answer,) = _until_done(decoder, decoder.add(first, None, GenerationConfig(6)))  # kept in row 0
    other = decoder.add([60, 61, 62, 63], None, GenerationConfig(6))  # shares nothing: takes row 0
    again = decoder.add(first + answer + [5], None, GenerationConfig(6))  # the kept cache, in row 1 now
    assert (other.stats.prompt_tokens_cached, again.stats.prompt_tokens_cached) == (0, len(first) + len(answer) - 1)
    expected = generate(quantized_target, first + answer + [5], None, GenerationConfig(6)).token_ids
    assert _until_done(decoder, other, again)[1] == expected
