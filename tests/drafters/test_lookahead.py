"""Lookahead decoding (Fu et al. 2024): n-gram pool and 2D-window bookkeeping (table-driven), the lookahead
attention mask against plain chains on both model paths, greedy equality with plain decoding, the sampled first
token's distribution (chi-square), and option validation."""

import itertools
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from specdraft.decoding import generate
from specdraft.drafters import parse_options
from specdraft.drafters.lookahead import (
    LookaheadDrafter,
    NgramPool,
    advance,
    harvest,
    level_lengths,
    ngram_trie,
    window_layout,
)
from specdraft.drafters.registry import make_named
from specdraft.errors import SpecdraftError
from specdraft.models.native_llama import NativeLlama
from specdraft.sampling import SamplingConfig, warp
from specdraft.sequence import GenerationConfig
from specdraft.trees import AuxBranch, verify_layout
from specdraft.verification import TreeVerifyResult
from toys import hf_target, tiny_llama

PROMPT = [5, 9, 3, 17, 9, 3, 22, 40]
# W = 3, N = 4, full: level 0 = the root + 2 tokens (offsets 1, 2), levels 1 and 2 (offsets 1..3 and 2..4)
FULL = [[10, 11], [20, 21, 22], [30, 31, 32]]


@pytest.mark.parametrize(
    "adds, key, expected",
    [
        ([(1, (2, 3))], 1, [(2, 3)]),
        ([(1, (2, 3)), (1, (4, 5))], 1, [(4, 5), (2, 3)]),  # most recent first
        ([(1, (2, 3)), (1, (4, 5)), (1, (2, 3))], 1, [(2, 3), (4, 5)]),  # re-adding refreshes, no duplicate
        ([(1, (2, 3)), (1, (4, 5)), (1, (6, 7))], 1, [(6, 7), (4, 5)]),  # capacity 2: least recent forgotten
        ([(1, (2, 3)), (8, (4, 5))], 8, [(4, 5)]),
        ([(1, (2, 3))], 7, []),
    ],
)
def test_pool_keeps_recent_continuations_per_key(adds, key, expected):
    pool = NgramPool(capacity=2)
    for k, continuation in adds:
        pool.add(k, continuation)
    assert pool.get(key) == expected


@pytest.mark.parametrize(
    "window, ngram, filled, expected",
    [(3, 4, 0, [4]), (3, 4, 1, [3, 4]), (3, 4, 2, [2, 3, 3]), (5, 3, 0, [5]), (5, 3, 1, [4, 5]), (1, 3, 1, [0, 1])],
)
def test_level_lengths(window, ngram, filled, expected):
    assert level_lengths(window, ngram, filled) == expected


def test_window_layout_offsets_and_lookahead_mask():
    tokens, offsets, mask = window_layout(FULL)
    assert tokens.tolist() == [10, 11, 20, 21, 22, 30, 31, 32]
    assert offsets.tolist() == [1, 2, 1, 2, 3, 2, 3, 4]
    attends = [row.nonzero().flatten().tolist() for row in mask]
    assert attends == [
        [0],  # level 0 is a causal chain
        [0, 1],
        [2],  # level 1, column 0: the root (the context), then itself
        [0, 3],  # level 1, column 1: level0[0], itself
        [0, 1, 4],
        [2, 5],  # level 2, column 0: level1[0], itself
        [0, 3, 6],
        [0, 1, 4, 7],  # offsets 1, 2, 3, 4: one chain of consecutive positions
    ]
    AuxBranch(tokens, offsets, mask)  # a valid auxiliary branch


def test_harvest_takes_each_column_chain_and_its_prediction():
    assert harvest(99, FULL, [40, 41, 42]) == [(99, (20, 30, 40)), (10, (21, 31, 41)), (11, (22, 32, 42))]


@pytest.mark.parametrize(
    "levels, predicted, shift, expected",
    [
        ([[1, 2, 3, 4]], [5, 6, 7, 8], 1, [[2, 3, 4], [5, 6, 7, 8]]),  # filling: level 1 from level 0's argmax
        ([[2, 3, 4], [5, 6, 7, 8]], [15, 16, 17, 18], 1, [[3, 4], [6, 7, 8], [16, 17, 18]]),  # now full
        ([[1, 2, 3, 4]], [5, 6, 7, 8], 2, [[3, 4, 90], [6, 7, 8, 91]]),
        (FULL, [40, 41, 42], 1, [[21, 22], [30, 31, 32], [40, 41, 42]]),  # full: the oldest level goes
        (FULL, [40, 41, 42], 2, [[22, 90], [31, 32, 91], [41, 42, 92]]),  # two tokens committed: two columns go
        (FULL, [40, 41, 42], 4, [[90, 91], [92, 93, 94], [95, 96, 97]]),
        (FULL, None, 1, [[11, 90], [21, 22, 91], [31, 32, 92]]),  # no lookahead logits: only move
        (FULL, None, 2, [[90, 91], [22, 92, 93], [32, 94, 95]]),
    ],
)
def test_advance_moves_the_window(levels, predicted, shift, expected):
    pad = itertools.count(90).__next__
    assert advance(levels, predicted, shift, window=3, ngram=4, pad=pad) == expected


def test_advance_keeps_offsets_consistent():
    """A token keeps its absolute position: offset in the old window - shift = offset in the new one."""
    old_tokens, old_offsets, _ = window_layout(FULL)
    where = dict(zip(old_tokens.tolist(), old_offsets.tolist(), strict=True))
    for shift in (1, 2):
        new = advance(FULL, [40, 41, 42], shift, 3, 4, itertools.count(90).__next__)
        tokens, offsets, _ = window_layout(new)
        where_new = {**where, 40: 3, 41: 4, 42: 5}  # the argmax at offsets 2, 3, 4 predicts offsets 3, 4, 5
        for token, offset in zip(tokens.tolist(), offsets.tolist(), strict=True):
            if token < 90:
                assert where_new[token] - shift == offset


def test_ngram_trie_merges_prefixes_and_cuts_depth():
    tokens, parents = ngram_trie([(1, 2, 3), (1, 2, 4), (5, 6, 7), (1, 9, 9)], depth=2)
    assert tokens.tolist() == [1, 2, 5, 6, 9] and parents.tolist() == [-1, 0, -1, 2, 0]
    tokens, parents = ngram_trie([], depth=3)
    assert tokens.shape == (0,) and parents.shape == (0,)


@pytest.fixture(scope="module", params=["native", "hf"])
def target(request):
    return NativeLlama.from_hf(tiny_llama(0)) if request.param == "native" else hf_target(0)


def test_window_logits_equal_their_chains(target):
    """One forward over tail + window gives each window token the logits of its chain (context, then the window
    tokens it attends in offset order) decoded as a plain sequence."""
    tokens, offsets, mask = window_layout(FULL)
    aux = AuxBranch(tokens, offsets, mask)
    cache = target.new_cache(64)
    target.forward(torch.tensor([PROMPT[:-2]]), cache)
    layout_offsets, layout_mask = verify_layout(2, torch.empty(0, dtype=torch.long), aux)
    fed = torch.cat([torch.tensor(PROMPT[-2:]), tokens])[None]  # (1, 2 + A)
    logits = target.forward(fed, cache, positions=cache.length + layout_offsets, attention_mask=layout_mask)[0]
    for row in range(tokens.shape[0]):
        seen = mask[row].nonzero().flatten()
        seen = seen[offsets[seen].argsort()]
        assert offsets[seen].tolist() == list(range(1, int(offsets[row]) + 1))
        chain = target.forward(torch.tensor([PROMPT + tokens[seen].tolist()]), target.new_cache(64))[0, -1]
        torch.testing.assert_close(logits[2 + row], chain, atol=1e-4, rtol=1e-4)


OPTIONS = [
    {},
    {"window": 3, "ngram": 3, "guess_set_size": 2},
    {"window": 7, "ngram": 5},
    {"always_forward_one": True},
    {"pool_from_context": True},
]


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("num_draft_tokens", [1, 4])
def test_greedy_lookahead_equals_plain(target, options, num_draft_tokens):
    plain = generate(target, PROMPT, None, GenerationConfig(60)).token_ids
    result = generate(target, PROMPT, LookaheadDrafter(**options),
                      GenerationConfig(60, num_draft_tokens, speculation="fixed"))
    assert result.token_ids == plain
    if num_draft_tokens == 4 and options in ({}, {"pool_from_context": True}):
        # tiny0's greedy output repeats ("53 38 53 38", "18 43 21 3"): the window finds those n-grams
        assert result.stats.block_efficiency > 1.2


@pytest.mark.parametrize("seed", [1, 2])
def test_greedy_equal_on_other_models_and_repeatable(seed):
    target = NativeLlama.from_hf(tiny_llama(seed))
    plain = generate(target, PROMPT, None, GenerationConfig(60)).token_ids
    drafter = LookaheadDrafter()
    first = generate(target, PROMPT, drafter, GenerationConfig(60, 3, speculation="fixed"))
    again = generate(target, PROMPT, drafter, GenerationConfig(60, 3, speculation="fixed"))  # begin() resets all
    assert first.token_ids == plain == again.token_ids
    assert first.stats.accept_lengths == again.stats.accept_lengths
    assert first.stats.block_efficiency > 1


def test_window_dropped_when_cache_is_short():
    """Near the end of a short context the loop drops the lookahead branch (aux_logits None); output is unchanged."""
    class Recording(LookaheadDrafter):
        def observe(self, result):
            dropped.append(result.aux_logits is None)
            super().observe(result)

    dropped = []
    target = NativeLlama.from_hf(tiny_llama(0, max_positions=48))
    plain = generate(target, PROMPT, None, GenerationConfig(40)).token_ids
    result = generate(target, PROMPT, Recording(), GenerationConfig(40, 4))
    assert result.token_ids == plain
    assert not dropped[0] and dropped[-1]


def test_observe_without_aux_logits_only_moves_the_window():
    drafter = LookaheadDrafter(window=3, ngram=4)
    drafter.propose(torch.tensor(PROMPT), 3, SamplingConfig(), None)
    before = [list(level) for level in drafter.levels]
    drafter.observe(TreeVerifyResult(0, 0, 7))
    assert len(drafter.pool) == 0 and len(drafter.levels) == 1
    assert drafter.levels[0][:3] == before[0][1:]


def test_propose_offers_pooled_ngrams_after_the_root():
    drafter = LookaheadDrafter(window=2, ngram=3, pool_from_context=True)
    draft = drafter.propose(torch.tensor([4, 7, 8, 4, 6, 6, 4]), 5, SamplingConfig(), None)
    assert draft.q is None and draft.is_tree
    assert draft.tokens.tolist() == [6, 6, 7, 8] and draft.parents.tolist() == [-1, 0, -1, 2]
    assert draft.aux.tokens.shape == (level_lengths(2, 3, 0)[0],)


# tiny0 (std 0.3): after this prompt, the pooled continuations of the root 9 start with tokens that carry about
# 0.6 of p's mass, so the first step's candidates are often accepted and the test exercises verification
SAMPLING_PROMPT = [5, 9, 3, 17, 9, 30, 22, 9, 55, 22, 9, 7, 22, 9]


def test_sampled_lookahead_matches_plain_sampling_marginal():
    target = NativeLlama.from_hf(tiny_llama(0))
    sampling = SamplingConfig(1.0)
    p = warp(target.forward(torch.tensor([SAMPLING_PROMPT]), target.new_cache(64))[0, -1], sampling)
    assert float(p[[3, 30, 55, 7]].sum()) > 0.5
    counts, accepted, trials = Counter(), 0, 1000
    for seed in range(trials):
        result = generate(target, SAMPLING_PROMPT, LookaheadDrafter(ngram=3, pool_from_context=True),
                          GenerationConfig(3, 2, sampling, speculation="fixed"), torch.Generator().manual_seed(seed))
        counts[result.token_ids[0]] += 1
        accepted += result.stats.accept_lengths[0] > 1
    assert accepted > trials // 4
    support = (p * trials >= 5).nonzero().flatten().tolist()
    observed = [counts[t] for t in support] + [trials - sum(counts[t] for t in support)]
    expected = [float(p[t]) * trials for t in support] + [trials * (1 - float(p[support].sum()))]
    if expected[-1] < 5:  # too little mass outside the support for its own bucket: it must stay rare
        assert observed[-1] <= 5 + 4 * expected[-1]
        observed, expected = observed[:-1], expected[:-1]
    expected = [e * sum(observed) / sum(expected) for e in expected]
    assert chisquare(observed, expected).pvalue > 1e-3


@pytest.mark.parametrize(
    "options, match",
    [
        ({"window": 0}, "window must be an integer >= 1"),
        ({"ngram": 2}, "ngram must be an integer >= 3"),
        ({"guess_set_size": 0}, "guess_set_size must be an integer >= 1"),
        ({"window": 2.5}, "window must be an integer"),
        ({"ngram": True}, "ngram must be an integer"),
        ({"seed": -1}, "seed must be an integer >= 0"),
    ],
)
def test_bad_options(options, match):
    with pytest.raises(SpecdraftError, match=match):
        LookaheadDrafter(**options)


def test_cli_factory_converts_and_checks_options():
    drafter = make_named("lookahead", None, None, parse_options("window=4;ngram=3;guess-set-size=2"))
    assert (drafter.window, drafter.ngram, drafter.guess_set_size) == (4, 3, 2)
    for text, match in [("window=0", "window must be"), ("window=five", "expected int"), ("level=3", "unknown")]:
        with pytest.raises(SpecdraftError, match=match):
            make_named("lookahead", None, None, parse_options(text))
