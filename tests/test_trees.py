"""Token trees: compilation, one-forward tree attention on both model paths, greedy tree decoding equal to plain
decoding, and multi-draft tree sampling whose output follows the target (chi-square)."""

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from specdraft.decoding import generate
from specdraft.drafters.base import Draft, TargetFeatures
from specdraft.drafters.draft_model import DraftModelDrafter
from specdraft.errors import SpecdraftError
from specdraft.models.native_llama import NativeLlama
from specdraft.sampling import SamplingConfig, warp
from specdraft.sequence import GenerationConfig
from specdraft.trees import (
    AuxBranch,
    ancestor_mask,
    chain_parents,
    check_tree,
    children,
    depths,
    insert_path,
    is_chain,
    keep_nodes,
    parents_from_paths,
    retrieve_indices,
    verify_layout,
)
from specdraft.verification import verify_tree_greedy, verify_tree_sampling
from toys import hf_target, tiny_llama

PROMPT = [5, 9, 3, 17, 9, 3, 22, 40]
#        root
#       /    \
#      0      1
#     / \     |
#    2   3    4
#    |
#    5
PARENTS = torch.tensor([-1, -1, 0, 0, 1, 2])


def test_structure():
    assert depths(PARENTS).tolist() == [1, 1, 2, 2, 2, 3]
    mask = ancestor_mask(PARENTS)
    assert mask[5].nonzero().flatten().tolist() == [0, 2, 5]
    assert mask[4].nonzero().flatten().tolist() == [1, 4]
    assert children(PARENTS) == [[0, 1], [2, 3], [4], [5], [], [], []]
    assert retrieve_indices(PARENTS).tolist() == [[0, 3, -1], [1, 4, -1], [0, 2, 5]]
    assert chain_parents(3).tolist() == [-1, 0, 1]


def test_parents_from_paths_orders_and_checks_prefixes():
    parents, paths = parents_from_paths([(0, 1), (1,), (0,), (0, 0), (0, 0, 0)])
    assert paths == [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]
    assert parents.tolist() == [-1, -1, 0, 0, 2]
    with pytest.raises(SpecdraftError, match="without its prefix"):
        parents_from_paths([(0,), (1, 0)])


@pytest.mark.parametrize("tokens, parents, path, out_tokens, out_parents", [
    # a sibling under the chain's first node, then a path that follows it
    ([5, 6, 7], [-1, 0, 1], [5, 9], [5, 6, 7, 9], [-1, 0, 1, 0]),
    ([5, 6, 7, 9], [-1, 0, 1, 0], [5, 9, 4, 4], [5, 6, 7, 9, 4, 4], [-1, 0, 1, 0, 3, 4]),
    # a path already in the tree adds nothing, wherever it ends
    ([5, 6, 7, 9], [-1, 0, 1, 0], [5, 9], [5, 6, 7, 9], [-1, 0, 1, 0]),
    ([5, 6, 7], [-1, 0, 1], [], [5, 6, 7], [-1, 0, 1]),
    # a path that extends the chain keeps it a chain
    ([5], [-1], [5, 6, 7], [5, 6, 7], [-1, 0, 1]),
    # a new root child; an empty tree
    ([5, 6], [-1, 0], [8], [5, 6, 8], [-1, 0, -1]),
    ([], [], [3, 4], [3, 4], [-1, 0]),
    # the deepest match is followed through a tree with two root children
    ([5, 8, 6], [-1, -1, 1], [8, 6, 2], [5, 8, 6, 2], [-1, -1, 1, 2]),
])
def test_insert_path(tokens, parents, path, out_tokens, out_parents):
    def long(values):
        return torch.tensor(values, dtype=torch.long)

    merged, tree = insert_path(long(tokens), long(parents), long(path))
    assert merged.tolist() == out_tokens and tree.tolist() == out_parents
    check_tree(merged, tree)


def test_is_chain():
    assert is_chain(torch.tensor([-1, 0, 1])) and is_chain(torch.empty(0, dtype=torch.long))
    assert not is_chain(torch.tensor([-1, 0, 0])) and not is_chain(torch.tensor([-1, -1]))


def test_keep_nodes_renumbers_and_refuses_orphans():
    kept, parents = keep_nodes(PARENTS, depths(PARENTS) <= 2)
    assert kept.tolist() == [0, 1, 2, 3, 4] and parents.tolist() == [-1, -1, 0, 0, 1]
    kept, parents = keep_nodes(PARENTS, torch.tensor([False, True, False, False, True, False]))
    assert kept.tolist() == [1, 4] and parents.tolist() == [-1, 0]
    with pytest.raises(SpecdraftError, match="descendants"):
        keep_nodes(PARENTS, torch.tensor([False, True, True, True, True, True]))


def test_verify_layout_positions_and_mask():
    aux = AuxBranch(torch.tensor([7, 8]), torch.tensor([1, 2]), torch.tensor([[True, False], [True, True]]))
    offsets, mask = verify_layout(2, PARENTS, aux)
    assert offsets.tolist() == [0, 1, 2, 2, 3, 3, 3, 4, 2, 3]
    assert mask[0].tolist()[:2] == [True, False] and mask[1, :2].all()
    assert mask[2:, :2].all()  # everything sees the whole tail
    node5 = 2 + 5
    assert mask[node5].nonzero().flatten().tolist() == [0, 1, 2, 4, 7]
    assert not mask[8:, 2:8].any() and not mask[2:8, 8:].any()  # tree and auxiliary branch never see each other
    assert mask[9, 8:].tolist() == [True, True]


@pytest.fixture(scope="module", params=["native", "hf"])
def target(request):
    return NativeLlama.from_hf(tiny_llama(0)) if request.param == "native" else hf_target(0)


def _chain_logits(target, tokens):
    cache = target.new_cache(64)
    return target.forward(torch.tensor([tokens]), cache)[0]  # (T, V)


def test_tree_forward_matches_each_path_as_a_chain(target):
    """One tree forward gives every node the logits its root-to-node path would give as a plain chain."""
    tokens = torch.tensor([11, 12, 13, 14, 15, 16])
    cache = target.new_cache(64)
    target.forward(torch.tensor([PROMPT[:-2]]), cache)
    tail = torch.tensor(PROMPT[-2:])
    offsets, mask = verify_layout(2, PARENTS)
    logits = target.forward(torch.cat([tail, tokens])[None], cache, positions=cache.length + offsets,
                            attention_mask=mask)[0]
    for path in retrieve_indices(PARENTS).tolist():
        path = [n for n in path if n >= 0]
        chain = _chain_logits(target, PROMPT + tokens[path].tolist())
        torch.testing.assert_close(logits[[2 + n for n in path]], chain[len(PROMPT):], atol=1e-4, rtol=1e-4)
    # keep only the path 0 -> 2 -> 5, then decode one more token: equal to the chain's next logits
    start = len(PROMPT)
    cache.compact(start, [start + 0, start + 2, start + 5])
    assert cache.length == start + 3
    nxt = target.forward(torch.tensor([[21]]), cache)[0, -1]
    chain = _chain_logits(target, PROMPT + [11, 13, 16, 21])
    torch.testing.assert_close(nxt, chain[-1], atol=1e-4, rtol=1e-4)


class OracleTreeDrafter:
    """A tree whose first branch holds wrong tokens and whose second holds the target's greedy continuation,
    corrupted at depth ``wrong_at`` (None: never), plus a wrong sibling under each oracle node."""

    name = "oracle-tree"
    vocab_size = None
    max_context = None

    def __init__(self, target, wrong_at=None) -> None:
        self.oracle = DraftModelDrafter(target)
        self.vocab = target.vocab_size
        self.wrong_at = wrong_at

    def begin(self, target, cache) -> None:
        pass

    def propose(self, context, num_draft_tokens, sampling, generator) -> Draft:
        right = self.oracle.propose(context, num_draft_tokens, SamplingConfig(), None).tokens.clone()
        if self.wrong_at is not None and self.wrong_at < right.shape[0]:
            right[self.wrong_at] = (right[self.wrong_at] + 1) % self.vocab
        tokens, parents = [(int(right[0]) + 3) % self.vocab], [-1]  # a wrong first child of the root
        previous = -1
        for token in right.tolist():
            tokens += [token, (token + 2) % self.vocab]
            parents += [previous, previous]
            previous = len(tokens) - 2
        return Draft(torch.tensor(tokens), parents=torch.tensor(parents))

    def observe(self, result) -> None:
        pass


@pytest.mark.parametrize("wrong_at", [None, 0, 2])
def test_greedy_tree_decoding_equals_plain(target, wrong_at):
    plain = generate(target, PROMPT, None, GenerationConfig(30)).token_ids
    result = generate(target, PROMPT, OracleTreeDrafter(target, wrong_at), GenerationConfig(30, 4, speculation="fixed"))
    assert result.token_ids == plain
    if wrong_at is None:
        assert result.stats.block_efficiency > 4
    elif wrong_at == 0:
        assert result.stats.draft_tokens_accepted == 0
    else:
        assert 2 < result.stats.block_efficiency <= 3


def test_verify_tree_greedy_follows_argmax():
    logits = torch.full((7, 20), -1.0)
    for row, best in enumerate([12, 13, 4, 15, 0, 9, 3]):
        logits[row, best] = 1.0
    tokens = torch.tensor([11, 12, 13, 14, 15, 16])
    result = verify_tree_greedy(tokens, PARENTS, logits)
    assert result.accepted_nodes == (1,) and result.next_token == 4  # root -> 12 (node 1); node 1 wants 4, has 15
    assert result.num_draft_tokens == 6 and result.depth == 3


def _sampled_tree_distribution(deterministic: bool, trials: int = 6000):
    """First two emitted tokens of one tree step, completed from p when only one is emitted; and the exact p."""
    vocab = 4
    gen = torch.Generator().manual_seed(0)
    sampling = SamplingConfig(1.0)

    def p_at(prefix):
        g = torch.Generator().manual_seed(1000 + hash(prefix) % 997)
        return warp(torch.randn(vocab, generator=g) * 1.5, sampling)

    def q_at(prefix):
        g = torch.Generator().manual_seed(2000 + hash(prefix) % 991)
        return warp(torch.randn(vocab, generator=g) * 1.5, sampling)

    counts = Counter()
    for _ in range(trials):
        if deterministic:  # top-2 of q at the root, top-1 under each: point masses
            first = q_at(()).topk(2).indices.tolist()
            tokens = first + [int(q_at((t,)).argmax()) for t in first]
            q = None
        else:  # two i.i.d. draws from q at the root, two i.i.d. draws under the first
            first = torch.multinomial(q_at(()), 2, replacement=True, generator=gen).tolist()
            second = torch.multinomial(q_at((first[0],)), 2, replacement=True, generator=gen).tolist()
            tokens = first + second
            q = torch.stack([q_at(()), q_at(()), q_at((first[0],)), q_at((first[0],))])
        parents = torch.tensor([-1, -1, 0, 1]) if deterministic else torch.tensor([-1, -1, 0, 0])
        rows = [()] + [tuple(tokens[n] for n in _path(parents, i)) for i in range(4)]
        p = torch.stack([p_at(r) for r in rows])  # (5, V)
        result = verify_tree_sampling(torch.tensor(tokens), parents, q, p, gen)
        emitted = [tokens[n] for n in result.accepted_nodes] + [result.next_token]
        if len(emitted) == 1:
            emitted.append(int(torch.multinomial(p_at(tuple(emitted)), 1, generator=gen)))
        counts[tuple(emitted[:2])] += 1
    expected = {(a, b): float(p_at(())[a] * p_at((a,))[b]) for a in range(vocab) for b in range(vocab)}
    return counts, expected


def _path(parents, node):
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return path[::-1]


@pytest.mark.parametrize("deterministic", [False, True])
def test_tree_sampling_follows_target(deterministic):
    counts, expected = _sampled_tree_distribution(deterministic)
    keys = sorted(expected)
    total = sum(counts.values())
    observed = [counts[k] for k in keys]
    weights = torch.tensor([expected[k] for k in keys], dtype=torch.float64)
    exp = (weights / weights.sum() * total).tolist()
    assert chisquare(observed, exp).pvalue > 1e-3


def test_sampled_tree_decoding_matches_plain_sampling_marginal():
    """End to end on a tiny model: the first sampled token after the prompt has the target's distribution."""
    target = NativeLlama.from_hf(tiny_llama(0, std=0.05))
    sampling = SamplingConfig(1.0)
    p = warp(_chain_logits(target, PROMPT)[-1], sampling)
    counts = Counter()
    trials = 1500
    for seed in range(trials):
        result = generate(target, PROMPT, OracleTreeDrafter(target, 1),
                          GenerationConfig(2, 3, sampling, speculation="fixed"), torch.Generator().manual_seed(seed))
        counts[result.token_ids[0]] += 1
    support = (p * trials >= 5).nonzero().flatten().tolist()
    observed = [counts[t] for t in support]
    exp = [float(p[t]) * trials for t in support]
    rest = trials * (1 - float(p[support].sum()))
    if rest >= 5:
        observed.append(trials - sum(observed))
        exp.append(rest)
    else:  # too little mass outside the support for a chi-square bucket: it must stay rare
        assert trials - sum(observed) <= 5 + 4 * rest
        exp = [e * sum(observed) / sum(exp) for e in exp]
    exp = [e * sum(observed) / sum(exp) for e in exp]
    assert chisquare(observed, exp).pvalue > 1e-3


@pytest.mark.parametrize("kind", ["native", "hf"])
@pytest.mark.parametrize("branching,nodes", [(1, 16), (2, 8), (3, 12)])
def test_draft_model_tree_mode_greedy_equals_plain(kind, branching, nodes):
    """The draft model's dynamic tree (top-k branching) keeps greedy output identical, on both model paths."""
    target = NativeLlama.from_hf(tiny_llama(0)) if kind == "native" else hf_target(0)
    draft_model = NativeLlama.from_hf(tiny_llama(0, layers=1)) if kind == "native" else hf_target(0, layers=1)
    plain = generate(target, PROMPT, None, GenerationConfig(30)).token_ids
    chain = generate(target, PROMPT, DraftModelDrafter(draft_model), GenerationConfig(30, 4))
    tree = generate(target, PROMPT, DraftModelDrafter(draft_model, tree_branching=branching, tree_nodes=nodes),
                    GenerationConfig(30, 4, speculation="fixed"))
    assert tree.token_ids == plain == chain.token_ids
    if branching == 1:  # a one-wide tree is the chain
        assert tree.stats.accept_lengths == chain.stats.accept_lengths
    else:
        assert tree.stats.block_efficiency >= chain.stats.block_efficiency


def test_draft_model_tree_nodes_are_the_most_confident_and_closed():
    draft_model = NativeLlama.from_hf(tiny_llama(1, layers=1))
    drafter = DraftModelDrafter(draft_model, tree_branching=3, tree_nodes=7)
    draft = drafter.propose(torch.tensor(PROMPT), 3, SamplingConfig(), None)
    assert len(draft) == 7 and draft.q is None
    assert int(depths(draft.parents).max()) <= 3
    first = _chain_logits(draft_model, PROMPT)[-1].topk(3).indices.tolist()
    assert draft.tokens[draft.parents == -1].tolist() == first[: int((draft.parents == -1).sum())]
    for node, parent in enumerate(draft.parents.tolist()):  # each node is a top-3 token after its path
        if parent >= 0:
            path = [int(draft.tokens[n]) for n in _path(draft.parents, parent)]
            assert int(draft.tokens[node]) in _chain_logits(draft_model, PROMPT + path)[-1].topk(3).indices.tolist()
    sampled = drafter.propose(torch.tensor(PROMPT), 3, SamplingConfig(1.0), torch.Generator().manual_seed(0))
    assert sampled.q is not None and sampled.q.shape == (len(sampled), draft_model.vocab_size)


def test_sampled_draft_model_tree_matches_target_marginal():
    target = NativeLlama.from_hf(tiny_llama(0, std=0.05))
    drafter = DraftModelDrafter(NativeLlama.from_hf(tiny_llama(3, std=0.05, layers=1)), tree_branching=2, tree_nodes=6)
    sampling = SamplingConfig(1.0)
    p = warp(_chain_logits(target, PROMPT)[-1], sampling)
    counts, trials = Counter(), 1200
    for seed in range(trials):
        generator = torch.Generator().manual_seed(seed)
        result = generate(target, PROMPT, drafter, GenerationConfig(2, 3, sampling, speculation="fixed"), generator)
        counts[result.token_ids[0]] += 1
    support = (p * trials >= 5).nonzero().flatten().tolist()
    observed, exp = [counts[t] for t in support], [float(p[t]) * trials for t in support]
    exp = [e * sum(observed) / sum(exp) for e in exp]
    assert trials - sum(observed) <= 5 + 4 * trials * (1 - float(p[support].sum()))
    assert chisquare(observed, exp).pvalue > 1e-3


class FeatureRecorder(OracleTreeDrafter):
    """Records the target features the loop hands over; proposes the oracle tree or, every other step, a chain."""

    def target_features(self) -> TargetFeatures:
        return TargetFeatures()

    def __init__(self, target, wrong_at=None) -> None:
        super().__init__(target, wrong_at)
        self.features, self.steps = [], 0

    def propose(self, context, num_draft_tokens, sampling, generator) -> Draft:
        self.steps += 1
        tree = super().propose(context, num_draft_tokens, sampling, generator)
        if self.steps % 2:
            return tree
        return Draft(self.oracle.propose(context, num_draft_tokens, SamplingConfig(), None).tokens[:2])

    def observe(self, result) -> None:
        self.features.append(result.hidden)


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_loop_hands_features_of_committed_tokens_to_drafters_that_ask(kind):
    """result.hidden holds the final-normed hidden state of every committed token fed to the target, in order:
    together they equal one teacher-forced forward over prompt + output (minus the last token, not yet fed)."""
    model = tiny_llama(0)
    target = NativeLlama.from_hf(model) if kind == "native" else hf_target(0)
    drafter = FeatureRecorder(target, wrong_at=2)
    result = generate(target, PROMPT, drafter, GenerationConfig(20, 4))
    assert result.token_ids == generate(target, PROMPT, None, GenerationConfig(20)).token_ids
    features = torch.cat(drafter.features)  # (N, D)
    sequence = PROMPT + result.token_ids[:-1]
    assert features.shape[0] == len(sequence)
    out = model(torch.tensor([sequence]), output_hidden_states=True)
    torch.testing.assert_close(features.float(), out.hidden_states[-1][0], atol=1e-4, rtol=1e-4)
