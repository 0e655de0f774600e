"""SuffixDecoding: suffix-tree counts and eviction (table-driven), the paper's expansion rules (MAX_SPEC = factor * p,
min_token_prob, best score wins), the global tree of earlier outputs, losslessness (greedy equality in fp32 and a
chi-square test of sampled sequences), and its options."""

import itertools
from collections import Counter

import pytest
import torch

from specdraft.decoding import generate
from specdraft.drafters import parse_options
from specdraft.drafters.registry import make_named
from specdraft.drafters.suffix import GLOBAL, LOCAL, SuffixDrafter, SuffixTree, speculate_path, speculate_tree
from specdraft.errors import SpecdraftError
from specdraft.models.native_llama import NativeLlama
from specdraft.sampling import SamplingConfig
from specdraft.sequence import GenerationConfig
from toys import assert_sequences_follow, bigram_sequence_probs, hf_target, random_bigram, tiny_llama

GREEDY = SamplingConfig()


def _counts(tree: SuffixTree) -> dict[tuple[int, ...], int]:
    out, todo = {}, [((), tree.root)]
    while todo:
        path, node = todo.pop()
        for token, child in node.children.items():
            out[path + (token,)] = child.count
            todo.append((path + (token,), child))
    return out


def _substrings(sequences, depth) -> dict[tuple[int, ...], int]:
    counts = Counter()
    for seq in sequences:
        for start, length in itertools.product(range(len(seq)), range(1, depth + 1)):
            if start + length <= len(seq):
                counts[tuple(seq[start : start + length])] += 1
    return dict(counts)


@pytest.mark.parametrize("sequences, depth", [
    ([[1, 2, 3, 1, 2, 4]], 3),
    ([[1, 2, 3, 1, 2, 4]], 1),
    ([[5, 5, 5, 5]], 2),
    ([[1, 2], [2, 1, 2], [3]], 4),
])
def test_tree_counts_every_substring_up_to_its_depth(sequences, depth):
    tree = SuffixTree(depth)
    for seq in sequences:
        tree.extend(seq)
    assert _counts(tree) == _substrings(sequences, depth)


def test_extending_a_sequence_piecewise_equals_adding_it_whole_and_removal_undoes_it():
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    whole, pieces = SuffixTree(4), SuffixTree(4)
    whole.extend(seq)
    active = None
    for cut in ([3, 1, 4], [1], [5, 9, 2, 6], [5, 3, 5]):
        active = pieces.extend(cut, active)
    assert _counts(pieces) == _counts(whole)
    whole.extend([7, 1, 4])
    whole.extend(seq, delta=-1)
    assert _counts(whole) == _substrings([[7, 1, 4]], 4)


def _tree(*sequences, depth=8) -> SuffixTree:
    tree = SuffixTree(depth)
    for seq in sequences:
        tree.extend(seq)
    return tree


def test_path_follows_the_most_frequent_child_until_its_probability_falls_below_the_minimum():
    tree = _tree([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6])  # after 1: 2 (4/4), 3 (3/4), 4 (2/3)
    found = speculate_path(tree.match([1]), 8, 0.1)
    assert found.tokens == [2, 3, 4] and found.parents == [-1, 0, 1]
    assert found.conditional == pytest.approx([1.0, 0.75, 2 / 3])
    assert found.score == pytest.approx(1.0 + 0.75 + 0.5)
    assert speculate_path(tree.match([1]), 8, 0.6).tokens == [2, 3]  # D(4) = 0.5 < 0.6
    assert speculate_path(tree.match([1]), 1, 0.1).tokens == [2]


def test_equally_frequent_children_prefer_the_most_recent():
    assert speculate_path(_tree([1, 7], [1, 8]).match([1]), 4, 0.1).tokens == [8]
    assert speculate_path(_tree([1, 8], [1, 7]).match([1]), 4, 0.1).tokens == [7]


def test_tree_takes_the_most_probable_nodes_best_first():
    tree = _tree([1, 2, 3], [1, 2, 3], [1, 2, 4], [1, 5, 6])  # after 1: 2 (.75) -> 3 (.5), 4 (.25); 5 (.25) -> 6
    found = speculate_tree(tree.match([1]), 8, 8, 0.1)
    assert list(zip(found.tokens, found.parents, strict=True)) == [(2, -1), (3, 0), (5, -1), (4, 0), (6, 2)]
    assert found.score == pytest.approx(0.75 + 0.5 + 0.25 + 0.25 + 0.25)
    assert speculate_tree(tree.match([1]), 3, 8, 0.1).tokens == [2, 3, 5]  # node limit
    assert speculate_tree(tree.match([1]), 8, 1, 0.1).tokens == [2, 5]  # depth limit
    assert speculate_tree(tree.match([1]), 8, 8, 0.3).tokens == [2, 3]  # min_token_prob


def test_draft_length_grows_with_the_match_length():
    """MAX_SPEC = factor * p: a one-token match drafts at most `factor` tokens, a longer one more."""
    drafter = SuffixDrafter(max_spec_factor=1, tree_nodes=0, max_cached_outputs=0)
    context = [9, 1, 2, 3, 4, 5, 6, 8, 1, 2, 3]  # "1 2 3" occurred before: p = 3
    draft = drafter.propose(torch.tensor(context), 8, GREEDY, None)
    assert draft.tokens.tolist() == [4, 5, 6] and draft.q is None and draft.parents is None
    assert draft.tokens.tolist()[:2] == drafter.propose(torch.tensor(context), 2, GREEDY, None).tokens.tolist()
    assert drafter.propose(torch.tensor([9, 1, 2, 3, 4, 5, 6, 8, 7, 3]), 8, GREEDY, None).tokens.tolist() == [4]
    assert drafter.draft_kind(torch.tensor(context), GREEDY) == 3
    assert drafter.propose(torch.tensor([1, 2, 3, 4]), 8, GREEDY, None).tokens.tolist() == []


def test_the_context_last_token_is_not_its_own_match():
    """The per-request tree holds the context but its last token, so a token seen once has no continuation."""
    drafter = SuffixDrafter(max_cached_outputs=0)
    assert len(drafter.propose(torch.tensor([4, 5, 6]), 4, GREEDY, None)) == 0
    assert drafter.propose(torch.tensor([4, 5, 6, 4]), 4, GREEDY, None).tokens.tolist()[:2] == [5, 6]


def test_earlier_outputs_feed_the_global_tree_with_eviction():
    drafter = SuffixDrafter(tree_nodes=0, max_cached_outputs=1)
    drafter.begin(None, None)
    for length in (3, 8):  # the prompt 1 2 3 (the first context a generation shows), then the output 20 .. 24
        drafter.propose(torch.tensor([1, 2, 3, 20, 21, 22, 23, 24][:length]), 4, GREEDY, None)
    drafter.begin(None, None)  # the output (all but the last token seen) joins the global tree
    assert list(drafter.outputs) == [[20, 21, 22, 23]]
    draft = drafter.propose(torch.tensor([7, 8, 20, 21]), 4, GREEDY, None)
    assert draft.tokens.tolist() == [22, 23] and draft.source.tolist() == [GLOBAL] * 2
    drafter.propose(torch.tensor([7, 8, 20, 21, 30, 31, 32]), 4, GREEDY, None)
    drafter.begin(None, None)  # the second output evicts the first
    assert list(drafter.outputs) == [[30, 31]]
    assert drafter.propose(torch.tensor([5, 22]), 4, GREEDY, None).tokens.tolist() == []
    local = drafter.propose(torch.tensor([5, 22, 40, 41, 5, 22]), 4, GREEDY, None)
    assert local.tokens.tolist() == [40, 41, 5] and local.source.tolist() == [LOCAL] * 3


@pytest.fixture(scope="module", params=["native", "hf"])
def target(request):
    return NativeLlama.from_hf(tiny_llama(0)) if request.param == "native" else hf_target(0)


@pytest.mark.parametrize("tree_nodes", [0, 8])
def test_greedy_equals_plain_decoding_and_repeated_answers_are_drafted(target, tree_nodes):
    prompt = [5, 9, 3, 17, 9, 3, 22, 40, 5, 9, 3, 17]
    plain = generate(target, prompt, None, GenerationConfig(40)).token_ids
    drafter = SuffixDrafter(tree_nodes=tree_nodes)
    config = GenerationConfig(40, 4, speculation="fixed")
    first = generate(target, prompt, drafter, config)
    again = generate(target, prompt, drafter, config)  # the first answer is in the global tree now
    assert first.token_ids == plain == again.token_ids
    assert again.stats.block_efficiency > max(2.5, first.stats.block_efficiency)



@pytest.mark.parametrize("tree_nodes", [0, 6])
@pytest.mark.parametrize("sampling", [SamplingConfig(1.0), SamplingConfig(0.8, top_k=3)])
def test_sampled_sequences_follow_the_target(tree_nodes, sampling):
    """Three sampled tokens follow the target's warped distribution (chi-square), with drafts from both trees
    (the global tree keeps growing with every sample, so drafts vary)."""
    target = random_bigram(5, seed=0)
    prompt = [0, 1, 2, 0, 1, 2, 0, 3, 4, 0]
    drafter = SuffixDrafter(tree_nodes=tree_nodes, max_spec_factor=3, max_cached_outputs=50)
    generator = torch.Generator().manual_seed(7)
    trials, config = 4000, GenerationConfig(3, 3, sampling, speculation="fixed")
    counts, accepted = Counter(), 0
    for _ in range(trials):
        result = generate(target, prompt, drafter, config, generator)
        counts[tuple(result.token_ids)] += 1
        accepted += result.stats.draft_tokens_accepted
    assert accepted > trials / 4  # drafts are accepted often
    assert_sequences_follow(counts, bigram_sequence_probs(target, prompt, 3, sampling), trials)


def test_options_by_name_and_bad_values():
    drafter = make_named("suffix", None, None, parse_options("tree_nodes=0;max_spec_factor=2;max_depth=16"))
    assert isinstance(drafter, SuffixDrafter)
    assert (drafter.tree_nodes, drafter.max_spec_factor, drafter.max_depth) == (0, 2.0, 16)
    with pytest.raises(SpecdraftError, match="unknown drafter option"):
        make_named("suffix", None, None, {"depth": "3"})
    for bad in ({"max_depth": 0}, {"min_token_prob": 1.5}, {"tree_nodes": -1}, {"max_cached_outputs": -2}):
        with pytest.raises(SpecdraftError, match="suffix option"):
            SuffixDrafter(**bad)
