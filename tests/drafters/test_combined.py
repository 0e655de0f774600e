"""Drafters that combine others: the option strings build them, they pass the drafter interface and its optional
capabilities on, and the draft model inside is found and replaced without touching the original."""

import pytest
import torch

from specdraft.drafters import (
    DraftModelDrafter,
    PromptLookupDrafter,
    WithChainCopies,
    WithPromptLookup,
    WithSiblings,
    draft_model_drafter,
)
from specdraft.drafters.base import TargetFeatures, draft_kind, target_features
from specdraft.drafters.combined import draft_model_of, with_model
from specdraft.errors import SpecdraftError
from specdraft.sampling import SamplingConfig
from toys import hf_target


def test_the_options_build_the_combination_they_name():
    model = hf_target(1)
    assert type(draft_model_drafter(model, confidence_threshold=0.3)) is DraftModelDrafter
    combined = draft_model_drafter(model, prompt_lookup=3, prompt_lookup_alone=1, siblings=1, chain_copy=2)
    assert isinstance(combined, WithPromptLookup) and combined.alone == 1
    assert isinstance(combined.inner, WithSiblings) and isinstance(combined.inner.inner, WithChainCopies)
    assert draft_model_of(combined) is combined.inner.inner.inner and draft_model_of(PromptLookupDrafter()) is None
    assert combined.name == draft_model_of(combined).name and combined.vocab_size == model.vocab_size
    with pytest.raises(SpecdraftError, match="chain drafts"):
        draft_model_drafter(model, tree_branching=2, prompt_lookup=3)


def test_a_combination_is_the_same_drafter_as_the_composition_spelled_out():
    model, context = hf_target(1), torch.tensor([7, 8, 9, 10, 11, 3, 7, 8])
    by_options = draft_model_drafter(model, prompt_lookup=3, siblings=1)
    spelled = WithPromptLookup(WithSiblings(DraftModelDrafter(model), 1), PromptLookupDrafter(3))
    a, b = (d.propose(context, 4, SamplingConfig(), None) for d in (by_options, spelled))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents) and torch.equal(a.source, b.source)


def test_combinations_pass_on_the_optional_capabilities():
    class Reader:
        name, vocab_size, max_context = "reader", None, None

        def __init__(self) -> None:
            self.seen = []

        def begin(self, target, cache) -> None:
            self.seen.append("begin")

        def propose(self, context, num_draft_tokens, sampling, generator):
            return PromptLookupDrafter().propose(context, num_draft_tokens, sampling, generator)

        def observe(self, result) -> None:
            self.seen.append("observe")

        def target_features(self) -> TargetFeatures:
            return TargetFeatures((1, 2))

    reader = Reader()
    combined = WithPromptLookup(reader, PromptLookupDrafter(2))
    assert target_features(combined) == TargetFeatures((1, 2))
    assert target_features(WithPromptLookup(PromptLookupDrafter(), PromptLookupDrafter())) is None
    combined.begin(None, None)
    combined.observe(None)
    assert reader.seen == ["begin", "observe"]
    assert draft_kind(combined, torch.tensor([1, 2, 3]), SamplingConfig()) is None  # the reader gives no hint
    alone = WithPromptLookup(reader, PromptLookupDrafter(2), alone=1)
    assert draft_kind(alone, torch.tensor([4, 5, 6, 4, 5]), SamplingConfig()) == ("copy", 2)


def test_with_model_copies_every_layer_and_leaves_the_original():
    model, other = hf_target(1), hf_target(2)
    combined = draft_model_drafter(model, prompt_lookup=3, chain_copy=2)
    swapped = with_model(combined, other)
    assert draft_model_of(swapped).model is other and draft_model_of(combined).model is model
    assert swapped is not combined and swapped.inner is not combined.inner
    with pytest.raises(SpecdraftError, match="no draft model"):
        with_model(PromptLookupDrafter(), other)
