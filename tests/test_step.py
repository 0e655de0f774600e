"""The one speculative step: a chain keeps the causal kernel, a tree gets positions and a mask; the rollback keeps
the accepted nodes (a crop when they lead); the one place that decides how much a step drafts."""

import inspect

import torch

from specdraft.drafters import DraftModelDrafter
from specdraft.drafters.base import Draft
from specdraft.sampling import SamplingConfig
from specdraft.speculation import FixedPolicy, StepBounds, fit, propose
from specdraft.step import OneSequence, StepInput, lay_out, roll_back, speculative_step
from specdraft.trees import AuxBranch, chain_parents
from specdraft.verification import verify, verify_greedy, verify_tree_greedy
from toys import TableCache, random_bigram


class RecordingCache(TableCache):
    def __init__(self, capacity: int, length: int) -> None:
        super().__init__(capacity)
        self.length, self.calls = length, []

    def crop(self, length: int) -> None:
        self.calls.append(("crop", length))
        super().crop(length)

    def compact(self, start: int, slots) -> None:
        self.calls.append(("compact", start, list(slots)))
        super().compact(start, slots)


def test_roll_back_crops_a_leading_path_and_compacts_any_other():
    cache = RecordingCache(64, 20)
    roll_back(cache, 12, [0, 1, 2])
    assert cache.calls == [("crop", 15)] and cache.length == 15
    cache = RecordingCache(64, 20)
    roll_back(cache, 12, [1, 3])
    assert cache.calls == [("compact", 12, [13, 15])] and cache.length == 14
    cache = RecordingCache(64, 20)
    roll_back(cache, 12, [])
    assert cache.calls == [("crop", 12)]


def test_a_chain_keeps_the_causal_kernel_and_a_tree_gets_positions_and_a_mask():
    context = torch.tensor([5, 6, 7])
    chain = lay_out(context, 2, Draft(torch.tensor([8, 9])))
    assert chain.offsets is None and chain.mask is None and chain.tokens.tolist() == [7, 8, 9] and chain.tail == 1
    tree = lay_out(context, 2, Draft(torch.tensor([8, 9, 4]), parents=torch.tensor([-1, -1, 0])))
    assert tree.offsets.tolist() == [0, 1, 1, 2] and tree.mask.shape == (4, 4) and not bool(tree.mask[2, 1])
    aux = AuxBranch(torch.tensor([3]), torch.tensor([1]), torch.ones(1, 1, dtype=torch.bool))
    with_aux = lay_out(context, 2, Draft(torch.tensor([8]), aux=aux))  # a chain with an auxiliary branch: a tree
    assert with_aux.tokens.tolist() == [7, 8, 3] and with_aux.mask is not None


def test_one_step_feeds_the_target_once_verifies_and_rolls_back():
    target = random_bigram(6, seed=0)
    calls = []
    forward = target.forward
    target.forward = lambda ids, cache, **kwargs: calls.append(sorted(kwargs)) or forward(ids, cache, **kwargs)
    cache = target.new_cache(32)
    cache.length = 3  # the context but its last token is cached
    context = torch.tensor([0, 1, 2, 3])
    argmax = target.table.argmax(-1)  # (V,) the bigram's greedy next token
    right = argmax[3]
    draft = Draft(torch.stack([right, (argmax[right] + 1) % 6]))  # first right, second wrong
    (step,) = speculative_step(OneSequence(target, cache), [StepInput(context, draft, SamplingConfig(), None)])
    assert calls == [[]]  # one forward, no positions and no mask: the causal kernel
    assert step.accepted == [int(right)] and step.tokens == [int(right), int(argmax[right])]
    assert cache.length == 4 + 1  # the context and the accepted token
    assert step.verified_logits.shape == (2, 6)


def test_verify_is_the_one_dispatch():
    logits = torch.randn(4, 6)
    tokens = logits.argmax(-1)[:3]
    assert verify(tokens, None, None, logits, SamplingConfig(), None) == verify_greedy(tokens, logits)
    parents = chain_parents(3)
    assert verify(tokens, parents, None, logits, SamplingConfig(), None) == verify_tree_greedy(tokens, parents, logits)
    assert verify_greedy(tokens, logits).accepted_nodes == tuple(range(verify_greedy(tokens, logits).num_accepted))


def test_propose_asks_the_policy_once_and_fits_what_the_drafter_returns():
    class TooLong:
        name, vocab_size, max_context = "too-long", None, None

        def __init__(self) -> None:
            self.asked = []

        def begin(self, target, cache) -> None:
            pass

        def propose(self, context, num_draft_tokens, sampling, generator) -> Draft:
            self.asked.append(num_draft_tokens)
            return Draft(torch.arange(num_draft_tokens + 3))

        def observe(self, result) -> None:
            pass

    drafter = TooLong()
    draft = propose(FixedPolicy(4), drafter, torch.tensor([1, 2, 3]), 2, StepBounds(2, 64, 64), SamplingConfig(), None)
    assert drafter.asked == [2] and len(draft) == 2  # the budget: min(γ, tokens left); the chain cut to it
    tree = Draft(torch.arange(5), parents=torch.tensor([-1, 0, 1, -1, 3]))
    fitted = fit(tree, 2, 64, 64)  # no deeper than the budget
    assert fitted.parents.tolist() == [-1, 0, -1, 2] and fitted.tokens.tolist() == [0, 1, 3, 4]
    assert fit(tree, 4, 3, 64).tokens.tolist() == [0, 1, 2]  # no more nodes than the cache has room for
    assert fit(Draft(torch.arange(2)), 4, 64, 64).parents is None  # a chain stays a chain


def test_the_draft_model_takes_at_most_four_settings():
    settings = [name for name in inspect.signature(DraftModelDrafter).parameters if name not in ("model", "name")]
    assert len(settings) <= 4, settings
