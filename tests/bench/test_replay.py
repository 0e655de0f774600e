"""Greedy replay gives exactly the accept lengths of a real greedy run (float32), without the target."""

import pytest
import torch

from specdraft.bench.replay import accepted_length, replay
from specdraft.decoding import generate
from specdraft.drafters import PromptLookupDrafter, draft_model_drafter
from specdraft.drafters.base import Draft
from specdraft.errors import SpecdraftError
from specdraft.models.native_llama import NativeLlama
from specdraft.sequence import GenerationConfig
from toys import tiny_llama


def test_accepted_length_follows_the_matching_path_of_a_tree():
    # root -> 5 -> 6 -> 7, and root -> 5 -> 9 -> 4 (a sibling under 5), root -> 8
    draft = Draft(torch.tensor([5, 6, 7, 9, 4, 8]), parents=torch.tensor([-1, 0, 1, 0, 3, -1]))
    assert accepted_length(draft, [5, 9, 4, 1], 4) == 3
    assert accepted_length(draft, [5, 9, 4, 1], 2) == 2  # cut at the step's draft depth
    assert accepted_length(draft, [8, 8], 4) == 1
    assert accepted_length(draft, [3], 4) == 0
    assert accepted_length(Draft(torch.tensor([5, 6, 7])), [5, 6], 3) == 2  # a chain; the answer ends first


@pytest.mark.parametrize("options", [{}, {"siblings": 1, "prompt_lookup": 2}, {"confidence_threshold": 0.4}])
@pytest.mark.parametrize("gamma, max_new", [(3, 30), (4, 17)])
def test_replay_equals_the_accept_lengths_of_a_real_run(options, gamma, max_new):
    target = NativeLlama.from_hf(tiny_llama(0))
    draft_model = NativeLlama.from_hf(tiny_llama(0, std=0.2))  # the target's weights, scaled: agrees in part
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    plain = generate(target, prompt, None, GenerationConfig(max_new)).token_ids
    real = generate(target, prompt, draft_model_drafter(draft_model, **options),
                    GenerationConfig(max_new, gamma, speculation="fixed"))
    assert real.token_ids == plain
    replayed = replay(draft_model_drafter(draft_model, **options), prompt, plain, gamma, max_new)
    assert replayed == real.stats.accept_lengths and sum(replayed) == len(plain)
    assert max(replayed) > 1  # some drafts were accepted: the replay had something to get right


def test_replay_of_prompt_lookup_and_bad_input():
    target = NativeLlama.from_hf(tiny_llama(0))
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    plain = generate(target, prompt, None, GenerationConfig(24)).token_ids
    real = generate(target, prompt, PromptLookupDrafter(2), GenerationConfig(24, 3, speculation="fixed"))
    assert replay(PromptLookupDrafter(2), prompt, plain, 3, 24) == real.stats.accept_lengths
    with pytest.raises(SpecdraftError, match="cannot replay"):
        replay(object(), prompt, plain, 3, 24)
    with pytest.raises(SpecdraftError, match="at most max_new_tokens"):
        replay(PromptLookupDrafter(2), prompt, plain, 3, 10)
