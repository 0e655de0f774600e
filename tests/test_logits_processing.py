"""Logit bias and penalties applied to the target's p at every verified position: counts along the draft's path,
greedy speculative output equal to a plain reference loop with the same processing (chains, trees, batches), and
sampling exact in distribution on the processed p (chi-square)."""

import itertools
from collections import Counter

import pytest
import torch

from specdraft.batching import generate_batch
from specdraft.decoding import generate
from specdraft.drafters import DraftModelDrafter, PromptLookupDrafter
from specdraft.drafters.base import Draft
from specdraft.models.native_llama import NativeLlama
from specdraft.sampling import LogitPenalties, SamplingConfig, path_counts, warp
from specdraft.sequence import GenerationConfig
from toys import PatternDrafter, assert_sequences_follow, hf_target, random_bigram, tiny_llama

PROMPT = [5, 9, 3, 17, 9, 3, 22, 40]
PENALTIES = LogitPenalties(logit_bias=((7, 2.5), (12, -100.0), (40, 1.5)), frequency_penalty=0.6,
                           presence_penalty=0.9)


def test_path_counts_follow_the_chain_and_the_tree():
    generated, tokens = torch.tensor([1, 1, 3]), torch.tensor([3, 2, 1])
    chain = path_counts(generated, tokens, None, 5)
    assert chain.tolist() == [[0, 2, 0, 1, 0], [0, 2, 0, 2, 0], [0, 2, 1, 2, 0], [0, 3, 1, 2, 0]]
    tree = path_counts(generated, tokens, torch.tensor([-1, -1, 1]), 5)  # nodes 0 and 1 siblings, 2 under 1
    assert tree.tolist() == [[0, 2, 0, 1, 0], [0, 2, 0, 2, 0], [0, 2, 1, 1, 0], [0, 3, 1, 1, 0]]


def test_penalties_by_hand():
    logits = torch.zeros(2, 4)
    out = LogitPenalties(((0, 1.0), (3, -2.0)), frequency_penalty=0.5, presence_penalty=0.25)(
        logits, torch.tensor([2, 2]), torch.tensor([0]), None)
    assert out.tolist() == [[1.0, 0.0, -1.25, -2.0], [0.25, 0.0, -1.25, -2.0]]
    assert not LogitPenalties().active and PENALTIES.active


def reference_greedy(model, prompt, processor, max_new):
    """Plain greedy decoding without a cache: the full forward each step, the processor on the last row."""
    ids = list(prompt)
    for _ in range(max_new):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1:]  # (1, V)
        generated = torch.tensor(ids[len(prompt):], dtype=torch.long)
        ids.append(int(processor(logits, generated, torch.zeros(0, dtype=torch.long), None).argmax(-1)))
    return ids[len(prompt):]


class ScriptDrafter:
    """Proposes the next tokens of a known answer, one changed where ``wrong(step, i)`` says so: drafts that the
    processed target accepts deep into the chain, so that every row's own counts decide."""

    name, max_context, vocab_size = "script", None, None

    def __init__(self, prompt_length: int, answer: list[int], wrong) -> None:
        self.prompt_length, self.answer, self.wrong, self.step = prompt_length, answer, wrong, 0

    def begin(self, target, cache) -> None:
        pass

    def propose(self, context, num_draft_tokens, sampling, generator) -> Draft:
        done = context.shape[0] - self.prompt_length
        tokens = self.answer[done : done + num_draft_tokens]
        tokens = [(t + 1) % 64 if self.wrong(self.step, i) else t for i, t in enumerate(tokens)]
        self.step += 1
        return Draft(torch.tensor(tokens, dtype=torch.long))

    def observe(self, result) -> None:
        pass


@pytest.fixture(scope="module")
def target():
    return hf_target(0)


@pytest.fixture(scope="module")
def expected(target):
    return reference_greedy(target.model, PROMPT, PENALTIES, 40)


def test_processing_changes_the_greedy_answer(target, expected):
    plain = generate(target, PROMPT, None, GenerationConfig(40)).token_ids
    assert plain != expected  # the test below could not tell processing from none otherwise
    assert 12 not in expected


@pytest.mark.parametrize("kind", ["plain", "script", "pattern", "draft-model", "prompt-lookup", "tree"])
def test_greedy_speculative_with_penalties_equals_plain_reference(target, expected, kind):
    drafter = {
        "plain": lambda: None,
        "script": lambda: ScriptDrafter(len(PROMPT), expected, lambda step, i: (step * 7 + i * 3) % 5 == 0),
        "pattern": lambda: PatternDrafter(target, lambda step, i: (step * 7 + i * 3) % 5 == 0),
        "draft-model": lambda: DraftModelDrafter(hf_target(1)),
        "prompt-lookup": PromptLookupDrafter,
        "tree": lambda: DraftModelDrafter(hf_target(1), tree_branching=2, tree_nodes=6),
    }[kind]()
    config = GenerationConfig(40, 4, speculation="fixed", logits_processor=PENALTIES)
    result = generate(target, PROMPT, drafter, config)
    assert result.token_ids == expected
    if kind == "script":  # deep acceptance and rejections at every position
        assert 0.3 < result.stats.acceptance_rate < 1 and result.stats.acceptance_rate_per_position[-1] > 0


def test_batched_rows_with_penalties_equal_the_reference():
    model = tiny_llama(0)
    native, drafter_model = NativeLlama.from_hf(model), NativeLlama.from_hf(tiny_llama(1))
    prompts = [PROMPT, [7], [11, 12, 13, 11, 12]]
    config = GenerationConfig(20, 3, speculation="fixed", logits_processor=PENALTIES)
    results = generate_batch(native, prompts, lambda: DraftModelDrafter(drafter_model), config)
    assert [r.token_ids for r in results] == [reference_greedy(model, p, PENALTIES, 20) for p in prompts]


def processed_sequence_probs(table, prompt, length, sampling, processor):
    """The exact probability of every continuation under a bigram target's processed, then warped, p."""
    probs = {}
    empty = torch.zeros(0, dtype=torch.long)
    for seq in itertools.product(range(table.shape[0]), repeat=length):
        prob, last = 1.0, prompt[-1]
        for i, token in enumerate(seq):
            row = processor(table[last][None], torch.tensor(seq[:i], dtype=torch.long), empty, None)  # (1, V)
            prob *= float(warp(row, sampling)[0, token])
            last = token
        probs[seq] = prob
    return probs


@pytest.mark.parametrize("sampling", [SamplingConfig(1.0), SamplingConfig(0.8, top_p=0.9)])
@pytest.mark.parametrize("drafter_kind", ["draft-model", "prompt-lookup"])
def test_sampling_with_penalties_follows_the_processed_distribution(sampling, drafter_kind):
    """Speculative samples of 3 tokens under bias and penalties follow the processed target distribution."""
    target, draft = random_bigram(5, seed=0), random_bigram(5, seed=1)
    processor = LogitPenalties(((1, 1.0), (4, -1.5)), frequency_penalty=0.8, presence_penalty=0.5)
    prompt = [0, 1, 2, 0, 1, 2, 0]
    drafter = DraftModelDrafter(draft) if drafter_kind == "draft-model" else PromptLookupDrafter()
    generator = torch.Generator().manual_seed(4321)
    config = GenerationConfig(3, 3, sampling, speculation="fixed", logits_processor=processor)
    results = [generate(target, prompt, drafter, config, generator) for _ in range(5000)]
    assert sum(r.stats.draft_tokens_proposed for r in results) > 0  # speculation was on
    counts = Counter(tuple(r.token_ids) for r in results)
    exact = processed_sequence_probs(target.table, prompt, 3, sampling, processor)
    assert_sequences_follow(counts, exact, 5000)
    unprocessed = processed_sequence_probs(target.table, prompt, 3, sampling, lambda logits, *rest: logits)
    assert max(abs(exact[s] - unprocessed[s]) for s in exact) > 0.05  # processing matters here
