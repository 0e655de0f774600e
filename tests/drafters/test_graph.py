"""Graph-structured drafts (GSD): merging by recent tokens (table-driven on the graph), reuse of the draft model's
distributions (a bigram draft model, whose prediction depends on the last token only, makes merging exact), the plain
tree mode when nothing merges, losslessness (greedy equality in fp32, chi-square of sampled sequences with merges and
a binding node budget), and the options."""

from collections import Counter

import pytest
import torch

from specdraft.decoding import generate
from specdraft.drafters import DraftModelDrafter
from specdraft.drafters.combined import draft_model_drafter
from specdraft.drafters.graph import COPIED, GraphDrafter, TokenGraph
from specdraft.errors import SpecdraftError
from specdraft.models.native_llama import NativeLlama
from specdraft.sampling import SamplingConfig
from specdraft.sequence import GenerationConfig
from specdraft.trees import children, depths
from toys import assert_sequences_follow, bigram_sequence_probs, hf_target, random_bigram, tiny_llama

GREEDY = SamplingConfig()
PROMPT = [5, 9, 3, 17, 9, 3, 22, 40]


def _point(token: int, vocab: int = 8) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(token), vocab).float() * 0.9 + 0.1 / vocab


@pytest.mark.parametrize("ngram, context, level1, level2, merged, pending", [
    # level 1: 3 and 4 after the context; both expanded. Level 2: under 3 -> (5, 6), under 4 -> (5, 7).
    (1, (9,), (3, 4), ((5, 6), (5, 7)), {}, {4: 2}),  # the second 5 merges into the first (same level)
    (2, (9,), (3, 4), ((5, 6), (5, 7)), {}, {}),  # "3 5" and "4 5" differ
    (0, (9,), (3, 4), ((5, 6), (5, 7)), {}, {}),  # merging off
    (1, (9,), (3, 4), ((3, 6), (5, 7)), {}, {}),  # a 3 under 3 has an expanded namesake, but it is its parent
    (1, (9,), (3, 4), ((4, 6), (5, 7)), {2: 1}, {}),  # a 4 under 3 merges into the expanded 4
])
def test_merge_by_recent_tokens(ngram, context, level1, level2, merged, pending):
    graph = TokenGraph(context, ngram)
    first = []
    for token in level1:
        first += graph.grow(-1, _point(token), 1, True, None)
    assert graph.merge(first) == (first, {})
    graph.expand(first, torch.stack([_point(0), _point(0)]), {})
    second = []
    for node, tokens in zip(first, level2, strict=True):
        for token in tokens:
            second += graph.grow(node, _point(token), 1, True, None)
    fresh, waiting = graph.merge(second)
    assert graph.rep == merged and waiting == pending
    assert set(fresh) == set(second) - set(merged) - set(pending)


def test_children_of_copies_are_not_fed_and_merge_in_turn():
    graph = TokenGraph((9,), 1)
    (a, b) = graph.grow(-1, _point(3), 1, True, None) + graph.grow(-1, _point(4), 1, True, None)
    graph.merge([a, b])
    graph.expand([a, b], torch.stack([_point(5), _point(4)]), {})
    (c,) = graph.grow(a, _point(5), 1, True, None)  # 3 -> 5, expanded next
    (d,) = graph.grow(b, _point(3), 1, True, None)  # 4 -> 3: merges into node a (3)
    assert graph.merge([c, d]) == ([c], {}) and graph.rep == {d: a}
    graph.expand([c], _point(6).unsqueeze(0), {})
    growing = graph.parents_of_next([c, d])
    assert [node for node, _ in growing] == sorted([c, d], key=lambda n: -graph.scores[n])
    (e,) = graph.grow(d, dict(growing)[d], 1, True, None)  # drawn from a's q row: 5, a copy of c
    assert graph.tokens[e] == 5 and not graph.real[e] and graph.keys[e] == (5,)
    graph.merge([e])
    assert graph.rep[e] == c  # the copy merges into c in turn
    assert graph.source().tolist() == [0, 0, 0, 0, COPIED]


def _bigram_top(table: torch.Tensor, token: int, k: int) -> set[int]:
    return set(table[token].topk(k).indices.tolist())


def test_bigram_draft_model_merged_nodes_get_the_children_the_model_would_give():
    """A bigram's prediction depends on the last token alone, so with merge_ngram=1 every node's children are the
    top-k after its own token, though the draft model ran on fewer nodes than have children."""
    draft_model = random_bigram(6, seed=3, scale=1.0)
    drafter = GraphDrafter(draft_model, tree_branching=2, tree_nodes=40, merge_ngram=1)
    draft = drafter.propose(torch.tensor([0, 1, 2]), 4, GREEDY, None)
    kids = children(draft.parents)
    with_children = [node for node in range(len(draft)) if kids[node + 1]]
    for node in with_children:
        assert {int(draft.tokens[c]) for c in kids[node + 1]} == _bigram_top(draft_model.table, int(draft.tokens[node]),
                                                                             2)
    assert {int(draft.tokens[c]) for c in kids[0]} == _bigram_top(draft_model.table, 2, 2)
    assert drafter.merged_nodes > 0 and drafter.expanded_nodes < len(with_children)
    assert (draft.source == COPIED).any() and int(depths(draft.parents).max()) == 4


@pytest.mark.parametrize("branching, nodes", [(2, 8), (3, 12)])
def test_without_merges_it_is_the_tree_mode(branching, nodes):
    model = NativeLlama.from_hf(tiny_llama(1, layers=1))
    plain = DraftModelDrafter(model, tree_branching=branching, tree_nodes=nodes)
    graph = GraphDrafter(model, tree_branching=branching, tree_nodes=nodes, merge_ngram=0)
    for context in (PROMPT, PROMPT + [7, 8]):
        a, b = (d.propose(torch.tensor(context), 3, GREEDY, None) for d in (plain, graph))
        assert (a.tokens.tolist(), a.parents.tolist()) == (b.tokens.tolist(), b.parents.tolist())


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_greedy_equals_plain_decoding_with_merges(kind):
    """The target drafts for itself, so the chain of its argmax is always right, except where a node on it was
    merged and its children come from another context's distribution."""
    target = NativeLlama.from_hf(tiny_llama(0)) if kind == "native" else hf_target(0)
    plain = generate(target, PROMPT, None, GenerationConfig(30)).token_ids
    drafter = GraphDrafter(target, tree_branching=3, tree_nodes=12, merge_ngram=1)
    result = generate(target, PROMPT, drafter, GenerationConfig(30, 4, speculation="fixed"))
    assert result.token_ids == plain
    assert drafter.merged_nodes > 0 and result.stats.block_efficiency > 1.2



@pytest.mark.parametrize("sampling", [SamplingConfig(1.0), SamplingConfig(0.8, top_k=3)])
def test_sampled_sequences_follow_the_target_with_merges_and_a_binding_budget(sampling):
    """Three sampled tokens follow the target's warped distribution (chi-square): merged nodes draw fresh children
    from a borrowed q row, and the node budget (7 < the 1 + 3 + 9 + ... nodes the graph could grow) cuts groups."""
    target, draft_model = random_bigram(5, seed=0), random_bigram(5, seed=1)
    drafter = GraphDrafter(draft_model, tree_branching=3, tree_nodes=7, merge_ngram=1)
    generator = torch.Generator().manual_seed(11)
    trials, config = 5000, GenerationConfig(3, 3, sampling, speculation="fixed")
    counts = Counter(tuple(generate(target, [0, 1, 2, 3], drafter, config, generator).token_ids)
                     for _ in range(trials))
    assert drafter.merged_nodes > trials  # merges happen at most steps
    assert_sequences_follow(counts, bigram_sequence_probs(target, [0, 1, 2, 3], 3, sampling), trials)


def test_sampled_graph_keeps_whole_groups_within_the_budget():
    drafter = GraphDrafter(random_bigram(5, seed=1), tree_branching=3, tree_nodes=7, merge_ngram=1)
    for seed in range(20):
        draft = drafter.propose(torch.tensor([0, 1, 2, 3]), 3, SamplingConfig(1.0), torch.Generator().manual_seed(seed))
        assert len(draft) <= 7 and draft.q is not None and draft.q.shape == (len(draft), 5)
        sizes = [len(group) for group in children(draft.parents)]
        assert sizes[0] == 3 and sum(size not in (0, 3) for size in sizes) <= 1  # at most the last group is cut


def test_options():
    model = hf_target(1)
    assert isinstance(draft_model_drafter(model, tree_branching=2, merge_ngram=2), GraphDrafter)
    assert type(draft_model_drafter(model, tree_branching=2)) is DraftModelDrafter
    for bad in ({"merge_ngram": 2}, {"merge_ngram": -1, "tree_branching": 2},
                {"merge_ngram": 1, "tree_branching": 2, "confidence_threshold": 0.3}):
        with pytest.raises(SpecdraftError, match="merge_ngram"):
            draft_model_drafter(model, **bad)
