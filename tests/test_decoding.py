"""The decoding loop: lossless greedy (token for token), lossless sampling (chi-square), stopping inside blocks."""

from collections import Counter

import pytest
import torch

from specdraft.costs import cost_curve
from specdraft.decoding import generate
from specdraft.drafters import DraftModelDrafter, PromptLookupDrafter, WithChainCopies, WithSiblings
from specdraft.errors import SpecdraftError
from specdraft.sampling import SamplingConfig
from specdraft.sequence import GenerationConfig
from toys import PatternDrafter, assert_sequences_follow, bigram_sequence_probs, hf_target, random_bigram

PROMPT = [5, 9, 3, 17, 9, 3, 22, 40]


@pytest.fixture(scope="module")
def target():
    return hf_target(0)


@pytest.fixture(scope="module")
def plain(target):
    return generate(target, PROMPT, None, GenerationConfig(40)).token_ids


PATTERNS = {
    "always": lambda step, i: False,
    "never": lambda step, i: i == 0,
    "sometimes": lambda step, i: (step * 7 + i * 3) % 5 == 0,
}


@pytest.mark.parametrize("speculation", ["fixed", "adaptive"])
@pytest.mark.parametrize("num_draft_tokens", [1, 3, 5])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_greedy_speculative_equals_autoregressive(target, plain, pattern, num_draft_tokens, speculation):
    drafter = PatternDrafter(target, PATTERNS[pattern])
    config = GenerationConfig(40, num_draft_tokens, speculation=speculation)
    result = generate(target, PROMPT, drafter, config)
    assert result.token_ids == plain
    if speculation == "adaptive":
        return  # how much it drafts follows this machine's measured costs: only the output is fixed
    stats = result.stats
    if pattern == "never":
        assert stats.draft_tokens_accepted == 0 and stats.block_efficiency == 1.0
    elif pattern == "always":
        assert stats.acceptance_rate == 1.0
    else:
        assert 0 < stats.acceptance_rate < 1


def test_autoregressive_equals_transformers_generate(target, plain):
    out = target.model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=40, eos_token_id=None,
                                pad_token_id=0)
    assert out[0, len(PROMPT):].tolist() == plain


def test_draft_model_and_prompt_lookup_greedy_equal(target, plain):
    for drafter in (DraftModelDrafter(hf_target(1)), PromptLookupDrafter()):
        result = generate(target, PROMPT, drafter, GenerationConfig(40, 4))
        assert result.token_ids == plain, drafter.name
        assert result.stats.target_forward_calls <= 40


@pytest.mark.parametrize("num_draft_tokens", [1, 2, 4])
def test_self_drafting_block_efficiency_is_gamma_plus_one(target, num_draft_tokens):
    max_new = 3 * (num_draft_tokens + 1)
    config = GenerationConfig(max_new, num_draft_tokens, speculation="fixed")  # adaptive would draft less: the
    result = generate(target, PROMPT, DraftModelDrafter(target), config)  # drafter costs as much as the target
    assert result.stats.block_efficiency == num_draft_tokens + 1
    assert result.stats.acceptance_rate_per_position == [1.0] * num_draft_tokens


@pytest.mark.parametrize("eos_index", range(11))  # every draft position and the bonus, over two blocks of 5
def test_eos_inside_a_block_ends_generation(target, plain, eos_index):
    eos = plain[eos_index]
    expected = plain[: plain.index(eos) + 1]
    config = GenerationConfig(40, 4, eos_token_ids=(eos,))
    for drafter in (None, DraftModelDrafter(target), PatternDrafter(target, PATTERNS["sometimes"])):
        result = generate(target, PROMPT, drafter, config)
        assert result.token_ids == expected
        assert result.finish_reason == "eos"


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 7])
def test_max_new_tokens_smaller_than_block(target, plain, max_new_tokens):
    result = generate(target, PROMPT, DraftModelDrafter(target), GenerationConfig(max_new_tokens, 5))
    assert result.token_ids == plain[:max_new_tokens]
    assert result.finish_reason == "length"


def test_stats_are_consistent(target):
    result = generate(target, PROMPT, PatternDrafter(target, PATTERNS["sometimes"]), GenerationConfig(30, 3))
    s = result.stats
    assert s.new_tokens == len(result.token_ids) == sum(s.accept_lengths) == 30
    assert s.target_forward_calls == len(s.accept_lengths)
    assert s.block_efficiency == pytest.approx(30 / s.target_forward_calls)
    assert s.draft_tokens_accepted == sum(s.accepted_per_position)
    assert sum(s.draft_length_counts) == s.target_forward_calls  # every step's verified draft length, counted once
    assert sum(n * c for n, c in enumerate(s.draft_length_counts)) == s.draft_tokens_proposed
    assert s.decode_seconds >= s.draft_seconds + s.verify_seconds
    assert set(s.to_dict()) >= {"new_tokens", "target_forward_calls", "block_efficiency", "acceptance_rate",
                                "decode_seconds", "tokens_per_second"}



@pytest.mark.parametrize(
    "sampling",
    [SamplingConfig(1.0), SamplingConfig(0.8, top_k=3), SamplingConfig(1.2, top_p=0.85), SamplingConfig(1.0, 4, 0.9)],
)
@pytest.mark.parametrize("drafter_kind", ["draft-model", "prompt-lookup", "chain-copy"])
def test_sampling_distribution_chi_square(sampling, drafter_kind):
    """Many speculative samples of 3 tokens follow the target's warped distribution (chi-square, p > 1e-3)."""
    target, draft = random_bigram(5, seed=0), random_bigram(5, seed=1)
    prompt = [0, 1, 2, 0, 1, 2, 0]  # repeats give prompt lookup something to copy
    drafter = {"draft-model": lambda: DraftModelDrafter(draft), "prompt-lookup": PromptLookupDrafter,
               "chain-copy": lambda: WithChainCopies(DraftModelDrafter(draft), 2)}[drafter_kind]()  # copied: point mass
    generator = torch.Generator().manual_seed(1234)
    config = GenerationConfig(3, 3, sampling)
    counts = Counter(tuple(generate(target, prompt, drafter, config, generator).token_ids) for _ in range(6000))
    assert_sequences_follow(counts, bigram_sequence_probs(target, prompt, 3, sampling), 6000)


def test_bad_inputs_are_clear_errors(target):
    with pytest.raises(SpecdraftError, match="empty prompt"):
        generate(target, [], None, GenerationConfig(4))
    with pytest.raises(SpecdraftError, match="prompt too long"):
        generate(target, [1] * 250, None, GenerationConfig(10))
    with pytest.raises(SpecdraftError, match="out of range"):
        generate(target, [1, 64], None, GenerationConfig(4))
    with pytest.raises(SpecdraftError, match="num_draft_tokens"):
        GenerationConfig(4, 0)
    with pytest.raises(SpecdraftError, match="max_new_tokens"):
        GenerationConfig(0)
    with pytest.raises(SpecdraftError, match="vocabulary mismatch"):
        generate(target, [1, 2], DraftModelDrafter(hf_target(1, vocab_size=80)), GenerationConfig(4))


def test_non_finite_target_logits_are_an_error():
    target = random_bigram(5, seed=0)
    target.table[3, 1] = float("nan")
    with pytest.raises(SpecdraftError, match="non-finite"):
        generate(target, [3], None, GenerationConfig(4))


def test_native_target_greedy_equals_transformers_generate_and_speculative():
    from specdraft.models.native_llama import NativeLlama
    from toys import tiny_llama

    hf_model = tiny_llama(0)
    native = NativeLlama.from_hf(hf_model)
    plain = generate(native, PROMPT, None, GenerationConfig(40)).token_ids
    out = hf_model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=40, eos_token_id=None,
                            pad_token_id=0)
    assert out[0, len(PROMPT):].tolist() == plain
    for drafter in (DraftModelDrafter(NativeLlama.from_hf(tiny_llama(1))), PromptLookupDrafter(),
                    PatternDrafter(native, PATTERNS["sometimes"])):
        assert generate(native, PROMPT, drafter, GenerationConfig(40, 4)).token_ids == plain


def test_other_architectures_run_through_transformers_with_cache_crop():
    """A GPT-2 target (not served natively) decodes speculatively through DynamicCache crops, losslessly."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from specdraft.models.hf import HFCausalLM

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=128, n_embd=32, n_layer=2, n_head=4, initializer_range=0.3)
    target = HFCausalLM(GPT2LMHeadModel(config).eval(), name="tiny-gpt2")
    plain = generate(target, PROMPT, None, GenerationConfig(30)).token_ids
    out = target.model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=30, eos_token_id=None,
                                pad_token_id=0)
    assert out[0, len(PROMPT):].tolist() == plain
    for drafter in (PatternDrafter(target, PATTERNS["sometimes"]), PromptLookupDrafter()):
        assert generate(target, PROMPT, drafter, GenerationConfig(30, 4)).token_ids == plain


def test_the_prompt_is_prefilled_on_the_causal_path_before_the_first_step():
    """All of the prompt but its last token is fed first as a plain forward (timed, not a step); tree steps then feed
    only the root and the tree with a mask: a masked forward over a long prompt costs more. Output unchanged."""
    from specdraft.models.native_llama import NativeLlama
    from toys import tiny_llama

    target = NativeLlama.from_hf(tiny_llama(0))
    prompt = list(range(3, 40))
    plain = generate(target, prompt, None, GenerationConfig(24)).token_ids
    cost_curve(target)  # the adaptive policy's calibration, measured (or read) before the forwards are recorded
    calls = []
    forward = target.forward

    def recorded(ids, cache, **kwargs):
        calls.append((ids.shape[1], "attention_mask" in kwargs))
        return forward(ids, cache, **kwargs)

    target.forward = recorded
    try:
        drafter = WithSiblings(DraftModelDrafter(NativeLlama.from_hf(tiny_llama(1))), 1)
        result = generate(target, prompt, drafter, GenerationConfig(24, 3))
        assert result.token_ids == plain
    finally:
        target.forward = forward
    assert calls[0] == (len(prompt) - 1, False)
    # then the root and at most 6 nodes, or a single token once no draft token is left to propose
    assert all(size <= 1 + 2 * 3 if masked else size == 1 for size, masked in calls[1:]), calls
    assert calls[1][1]
    assert result.stats.target_forward_calls == len(calls) - 1 == len(result.stats.accept_lengths)
    assert 0 < result.stats.prefill_seconds < result.stats.decode_seconds


@pytest.mark.parametrize("speculation", ["adaptive", "fixed"])
def test_bf16_greedy_speculative_equals_plain_on_the_row_kernels(speculation: str):
    """With the row-invariant kernels (``rows`` packing) a verify computes each token exactly as a plain step does,
    so bf16 speculative output equals bf16 plain decoding token for token, chains and trees alike."""
    from specdraft.models import rowgemm
    from specdraft.models.native_llama import NativeLlama
    from toys import tiny_llama

    if not rowgemm.available():
        pytest.skip("no AVX2 CPU or C++ compiler for the row kernel")
    target = NativeLlama.from_hf(tiny_llama(0, std=0.1), dtype=torch.bfloat16)
    assert target.prepack("rows")
    prompt = list(range(3, 30))
    plain = generate(target, prompt, None, GenerationConfig(48)).token_ids
    draft = NativeLlama.from_hf(tiny_llama(1, std=0.1), dtype=torch.bfloat16)
    for drafter in (DraftModelDrafter(draft), WithSiblings(DraftModelDrafter(draft), 1), PromptLookupDrafter(),
                    PatternDrafter(target, PATTERNS["sometimes"])):
        config = GenerationConfig(48, 4, speculation=speculation)
        assert generate(target, prompt, drafter, config).token_ids == plain


@pytest.fixture(scope="module")
def quantized():
    from specdraft.models.native_llama import NativeLlama
    from specdraft.models.quantized_llama import QuantizedLlama
    from toys import tiny_llama

    return QuantizedLlama.from_dense(NativeLlama.from_hf(tiny_llama(0)), "int4")


def _prefilled(target, run):
    """The prompt tokens ``run()`` feeds before each sequence's first step, one entry a sequence (0: none)."""
    fed, forward = [], target.forward

    def recorded(ids, cache, **kwargs):
        if kwargs.get("logits_to_keep") == 1:  # a prefill (steps keep every row)
            fed.append(ids.shape[1])
        return forward(ids, cache, **kwargs)

    target.forward = recorded
    try:
        return run(), fed
    finally:
        target.forward = forward


@pytest.mark.parametrize("drafter_kind", ["plain", "prompt-lookup", "draft-model"])
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.8, top_k=20)])
def test_a_kept_prefix_is_read_not_fed_and_every_answer_stays_the_same(quantized, drafter_kind, sampling):
    from specdraft.decoding import PrefixCache
    from specdraft.models.native_llama import NativeLlama
    from toys import tiny_llama

    draft_model = NativeLlama.from_hf(tiny_llama(1))
    make = {"plain": lambda: None, "prompt-lookup": lambda: PromptLookupDrafter(3, 1),
            "draft-model": lambda: DraftModelDrafter(draft_model)}[drafter_kind]
    config = GenerationConfig(20, 3, sampling, speculation="fixed")  # drafts (so draws) that follow no timing
    first = list(range(3, 40))
    answer = generate(quantized, first, make(), config, torch.Generator().manual_seed(0)).token_ids
    second = first + answer + [7, 8, 9]  # a conversation's next turn: the first turn and its answer, then more
    prompts = [first, second, first[:10] + [50, 51, 52], [60, 61], second]

    def answers(kept):
        return [generate(quantized, p, make(), config, torch.Generator().manual_seed(i), prefix_cache=kept).token_ids
                for i, p in enumerate(prompts)]

    fresh, fed_fresh = _prefilled(quantized, lambda: answers(None))
    kept = PrefixCache()
    reused, fed = _prefilled(quantized, lambda: answers(kept))
    assert reused == fresh  # bit-exact reads: greedy and sampled answers alike
    assert fed_fresh == [len(p) - 1 for p in prompts]
    # the last answer token, 7, 8 after the first turn; 50, 51 after 10 shared; 60 alone; second's all again
    assert fed == [len(first) - 1, 3, 2, 1, len(second) - 1]
    assert kept.cache is not None and kept.cache.length == kept.ids.shape[0] > len(second)


def test_a_prefix_cache_is_left_alone_where_reads_would_not_be_exact_and_emptied_by_a_failure(quantized,
                                                                                             monkeypatch):
    import specdraft.decoding as decoding
    from specdraft.decoding import PrefixCache
    from specdraft.models.native_llama import NativeLlama
    from toys import tiny_llama

    dense = NativeLlama.from_hf(tiny_llama(0))  # SDPA prefill: a long read differs from steps in the last bits
    kept = PrefixCache()
    assert generate(dense, PROMPT, None, GenerationConfig(8), prefix_cache=kept).token_ids == \
        generate(dense, PROMPT, None, GenerationConfig(8)).token_ids
    assert kept.cache is None and not getattr(dense, "reads_prefix_exactly", False)
    expected = generate(quantized, PROMPT + [4], None, GenerationConfig(8)).token_ids
    generate(quantized, PROMPT, None, GenerationConfig(8), prefix_cache=kept)
    assert kept.cache is not None
    step = decoding.speculative_step
    monkeypatch.setattr(decoding, "speculative_step", lambda *a: (_ for _ in ()).throw(RuntimeError("broken")))
    with pytest.raises(RuntimeError, match="broken"):
        generate(quantized, PROMPT + [4], None, GenerationConfig(8), prefix_cache=kept)
    assert kept.cache is None  # half-written keys are never read again
    monkeypatch.setattr(decoding, "speculative_step", step)
    assert generate(quantized, PROMPT + [4], None, GenerationConfig(8), prefix_cache=kept).token_ids == expected
