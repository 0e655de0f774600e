"""REST drafter: trie construction (table-driven), retrieval, losslessness (greedy equality and a chi-square test of
sampled tokens), and its options."""

from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdraft.datastore import Datastore
from specdraft.decoding import generate
from specdraft.drafters.registry import make_named
from specdraft.drafters.rest import RESTDrafter, continuation_trie
from specdraft.errors import SpecdraftError
from specdraft.models.native_llama import NativeLlama
from specdraft.sampling import SamplingConfig, warp
from specdraft.sequence import GenerationConfig
from toys import hf_target, tiny_llama

GREEDY = SamplingConfig()
PROMPT = [5, 9, 3, 17, 9, 3, 22, 40]
ROWS = [[5, 6, 7], [5, 6, 8], [5, 6, 7], [9, 1, -1]]  # prefix counts: 5:3, 56:3, 567:2, 568:1, 9:1, 91:1


@pytest.mark.parametrize("rows, max_nodes, max_candidates, tokens, parents", [
    # best-first by prefix count; ties: shallower first, then the continuation that sorts first
    (ROWS, 32, 8, [5, 6, 7, 9, 1, 8], [-1, 0, 1, -1, 3, 1]),
    (ROWS, 3, 8, [5, 6, 7], [-1, 0, 1]),  # node cap
    (ROWS, 32, 2, [5, 6, 7, 9, 1], [-1, 0, 1, -1, 3]),  # two candidates: 5 6 7 and 9 1; 5 6 8 would be a third
    (ROWS, 32, 1, [5, 6, 7], [-1, 0, 1]),  # one candidate: the most frequent path
    ([[3, -1], [2, -1]], 32, 8, [2, 3], [-1, -1]),  # a tie at the root: smaller continuation first
    ([[4, 4, 4]] * 3 + [[2, 9, -1]] * 2 + [[7, -1, -1]], 32, 2, [4, 4, 4, 2, 9], [-1, 0, 1, -1, 3]),
    ([[-1, -1], [-1, -1]], 32, 8, [], []),  # every continuation ended at once
    (np.empty((0, 4), dtype=np.int32), 32, 8, [], []),
])
def test_continuation_trie(rows, max_nodes, max_candidates, tokens, parents):
    assert continuation_trie(np.asarray(rows, dtype=np.int32), max_nodes, max_candidates) == (tokens, parents)


def test_trie_nodes_are_most_frequent_prefixes_on_random_rows():
    """Without the candidate cap, the kept nodes are exactly the top-N prefixes by count (REST's heap)."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        rows = rng.integers(0, 3, size=(int(rng.integers(1, 30)), 4)).astype(np.int32)
        counts = Counter(tuple(r[: d + 1]) for r in rows.tolist() for d in range(4))
        tokens, parents = continuation_trie(rows, 10, 10**6)
        paths = []
        for token, parent in zip(tokens, parents, strict=True):
            paths.append((paths[parent] if parent >= 0 else ()) + (token,))
        assert len(set(paths)) == len(paths) == min(10, len(counts))
        kept = sorted((counts[p] for p in paths), reverse=True)
        assert kept == sorted(counts.values(), reverse=True)[: len(kept)]


def _store(*docs):
    return Datastore.from_documents([list(d) for d in docs])


def _propose(store, context, k=3, **kwargs):
    draft = RESTDrafter(store=store, **kwargs).propose(torch.tensor(context), k, GREEDY, None)
    assert draft.q is None
    if not len(draft):
        return [], []
    assert draft.parents is not None
    return draft.tokens.tolist(), draft.parents.tolist()


def test_longest_suffix_wins_and_continuations_stop_at_document_end():
    store = _store([1, 2, 3, 4, 5, 6], [9, 3, 4, 7, 7], [3, 4, 7])
    # "2 3 4" occurs once (-> 5 6 ...); "3 4" alone would also give 7 (twice, more frequent)
    assert _propose(store, [8, 2, 3, 4]) == ([5, 6], [-1, 0])
    # "3 4": 7 (twice), then 5, then the depth-2 ties 5 6 and 7 7 in sorted order
    assert _propose(store, [8, 8, 3, 4]) == ([7, 5, 6, 7], [-1, -1, 1, 0])
    assert _propose(store, [1, 2, 3, 4], max_suffix=2) == ([7, 5, 6, 7], [-1, -1, 1, 0])
    assert _propose(store, [0, 2, 3, 4], min_suffix=4) == ([], [])  # no 4-token match


def test_no_match_and_match_only_at_document_ends():
    store = _store([1, 2, 3], [4, 5, 6])
    assert _propose(store, [7, 8]) == ([], [])
    assert _propose(store, [2, 3]) == ([], [])  # "2 3" ends its document and "3" alone is below min_suffix
    assert _propose(store, [2, 3], min_suffix=1) == ([], [])
    assert _propose(_store([1, 2, 3], [3, 9]), [2, 3], min_suffix=1) == ([9], [-1])  # falls back to "3"


def test_draft_depth_is_at_most_num_draft_tokens_and_nodes_capped():
    store = _store(*[[1, 2, 10, 20 + i, 30 + i, 40 + i] for i in range(20)])
    tokens, parents = _propose(store, [1, 2], k=2, max_nodes=7, max_candidates=50)
    assert tokens == [10, 20, 21, 22, 23, 24, 25] and parents == [-1] + [0] * 6
    assert _propose(store, [1, 2], k=1) == ([10], [-1])


@pytest.fixture(scope="module", params=["native", "hf"])
def target(request):
    return NativeLlama.from_hf(tiny_llama(0)) if request.param == "native" else hf_target(0)


def test_greedy_equals_plain_decoding(target):
    plain = generate(target, PROMPT, None, GenerationConfig(40)).token_ids
    rng = np.random.default_rng(0)
    noise = [rng.integers(3, 64, 30).tolist() for _ in range(20)]
    wrong = [t if i % 5 else (t + 1) % 64 for i, t in enumerate(plain)]  # the greedy text with mistakes
    store = _store(PROMPT + plain[:25], PROMPT[-3:] + wrong, *noise)
    result = generate(target, PROMPT, RESTDrafter(store=store), GenerationConfig(40, 4, speculation="fixed"))
    assert result.token_ids == plain
    assert result.stats.block_efficiency > 1.5
    assert result.stats.draft_tokens_accepted < result.stats.draft_tokens_proposed


def test_sampled_first_token_follows_target():
    """The first sampled token after the prompt has the target's distribution p (chi-square), with a tree whose
    root children are the target's likely tokens in a datastore-given order."""
    target = NativeLlama.from_hf(tiny_llama(0, std=0.05))
    sampling = SamplingConfig(1.0)
    p = warp(target.forward(torch.tensor([PROMPT]), target.new_cache(64))[0, -1], sampling)  # (V,)
    a, b, c, d = p.topk(4).indices.tolist()
    store = _store(*[PROMPT[-3:] + [a, 11]] * 3, *[PROMPT[-3:] + [c, 12]] * 2, PROMPT[-3:] + [d, 13],
                   PROMPT[-3:] + [b])
    drafter = RESTDrafter(store=store)
    assert drafter.propose(torch.tensor(PROMPT), 3, sampling, None).tokens.tolist()[:4] == [a, 11, c, 12]
    counts = Counter()
    trials, config = 1500, GenerationConfig(2, 3, sampling, speculation="fixed")
    accepted = 0
    for seed in range(trials):
        result = generate(target, PROMPT, drafter, config, torch.Generator().manual_seed(seed))
        counts[result.token_ids[0]] += 1
        accepted += result.stats.draft_tokens_accepted > 0
    assert 0.05 * trials < accepted < 0.95 * trials  # drafts are sometimes accepted, sometimes not
    support = (p * trials >= 5).nonzero().flatten().tolist()
    observed = [counts[t] for t in support] + [trials - sum(counts[t] for t in support)]
    expected = [float(p[t]) * trials for t in support] + [trials * (1 - float(p[support].sum()))]
    if expected[-1] < 5:  # too little mass outside the support for a bucket: it must stay rare
        assert observed.pop() <= 5 + 4 * expected.pop()
    expected = [e * sum(observed) / sum(expected) for e in expected]
    assert chisquare(observed, expected).pvalue > 1e-3


def test_bad_options():
    store = _store([1, 2, 3])
    with pytest.raises(SpecdraftError, match="min_suffix"):
        RESTDrafter(store=store, min_suffix=3, max_suffix=2)
    for key in ("max_nodes", "max_candidates", "max_occurrences"):
        with pytest.raises(SpecdraftError, match=key):
            RESTDrafter(store=store, **{key: 0})


def test_missing_default_datastore_says_how_to_build_it(tmp_path, monkeypatch):
    from toys import tiny_tokenizer

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    with pytest.raises(SpecdraftError, match="specdraft build-datastore"):
        make_named("rest", None, tiny_tokenizer(), {})
    with pytest.raises(SpecdraftError, match="build-datastore"):
        make_named("rest", None, tiny_tokenizer(), {"datastore": str(tmp_path / "nowhere")})
    with pytest.raises(SpecdraftError, match="unknown drafter option"):
        make_named("rest", None, tiny_tokenizer(), {"store": "x"})
