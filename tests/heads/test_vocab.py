"""EAGLE and Medusa drafting from an FR-Spec draft vocabulary (``draft_vocab``, :mod:`specdraft.draft_vocab`):
lossless (greedy equality on both model paths, the sampled marginal by chi-square), never proposing a token outside
the subset, and the ranking stored with exported heads."""


import pytest
import torch
from test_eagle import PROMPTS, _train_toy_head
from test_medusa import _train_toy_heads

from specdraft.decoding import generate
from specdraft.draft_vocab import rank_tokens
from specdraft.drafters.eagle import EagleDrafter
from specdraft.drafters.medusa import MedusaDrafter
from specdraft.errors import SpecdraftError
from specdraft.heads import save_heads
from specdraft.heads.eagle import eagle_spec
from specdraft.models.hf import HFCausalLM
from specdraft.models.native_llama import NativeLlama
from specdraft.sampling import SamplingConfig
from specdraft.sequence import GenerationConfig
from toys import assert_follows, sample_second_tokens, second_token_marginal, tiny_llama


@pytest.fixture(scope="module")
def eagle():
    model = tiny_llama(0).requires_grad_(False)
    return model, _train_toy_head(model, PROMPTS)


@pytest.fixture(scope="module")
def medusa():
    model = tiny_llama(0)
    return model, _train_toy_heads(model, PROMPTS)


def _record(drafter) -> list:
    """Wrap ``drafter.propose`` so that every draft it returns is also appended to the returned list."""
    proposed, original = [], drafter.propose

    def propose(*args):
        proposed.append(original(*args))
        return proposed[-1]

    drafter.propose = propose
    return proposed


def _keep(model, size: int, seed: int = 0) -> torch.Tensor:
    """A subset of ``size`` token ids that holds the target's greedy continuations of PROMPTS (so drafts can be
    accepted) plus random others."""
    target = NativeLlama.from_hf(model)
    used = {t for p in PROMPTS for t in generate(target, p, None, GenerationConfig(30)).token_ids}
    rest = [t for t in torch.randperm(64, generator=torch.Generator().manual_seed(seed)).tolist() if t not in used]
    return torch.tensor(sorted(used) + rest[: max(size - len(used), 0)])


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_eagle_with_a_draft_vocab_is_greedy_lossless_and_stays_inside(eagle, kind):
    model, head = eagle
    target = NativeLlama.from_hf(model) if kind == "native" else HFCausalLM(model)
    for size in (1, 20, 40):
        keep = _keep(model, size)
        drafter = EagleDrafter.from_module(head, top_k=3, tree_nodes=8, keep=keep)
        proposed = _record(drafter)
        for prompt in PROMPTS[:2] + [[40, 41, 42]]:
            plain = generate(target, prompt, None, GenerationConfig(24)).token_ids
            assert generate(target, prompt, drafter, GenerationConfig(24, 4)).token_ids == plain
        drafted = torch.cat([d.tokens for d in proposed])
        assert drafted.numel() and torch.isin(drafted, keep).all()


def test_eagle_with_a_draft_vocab_keeps_the_sampled_marginal(eagle):
    model, head = eagle
    target = NativeLlama.from_hf(model)
    prompt, sampling = PROMPTS[0], SamplingConfig(1.0)
    drafter = EagleDrafter.from_module(head, top_k=3, tree_nodes=8, keep=_keep(model, 16))
    counts, _ = sample_second_tokens(target, prompt, drafter, sampling, trials=800)
    assert_follows(counts, second_token_marginal(model, prompt, sampling), 800)


def test_medusa_with_a_draft_vocab_is_greedy_lossless_and_stays_inside(medusa):
    model, heads = medusa
    target = NativeLlama.from_hf(model)
    keep = _keep(model, 20)
    for drafter in (MedusaDrafter.from_module(heads, keep=keep),
                    MedusaDrafter.from_module(heads, tree_nodes=8, top_k=3, keep=keep)):
        proposed = _record(drafter)
        for prompt in PROMPTS[:2]:
            plain = generate(target, prompt, None, GenerationConfig(24)).token_ids
            assert generate(target, prompt, drafter, GenerationConfig(24, 4)).token_ids == plain
        drafted = torch.cat([d.tokens for d in proposed])
        assert drafted.numel() and torch.isin(drafted, keep).all()


def test_exported_heads_carry_the_ranking_and_draft_vocab_loads_it(eagle, tmp_path):
    from specdraft.draft_vocab import save_token_ranking

    model, head = eagle
    folder = save_heads(head, "eagle", eagle_spec(model.config, None, {}), tmp_path / "h", "tiny", ranking=rank_tokens(
        [[9, 9, 9, 4, 4, 1]], 64))
    drafter = EagleDrafter(str(folder), draft_vocab=2)
    assert drafter.keep.tolist() == [9, 4]
    save_token_ranking(folder, torch.arange(64))
    assert EagleDrafter(str(folder), draft_vocab=0).keep is None
    with pytest.raises(SpecdraftError, match="draft_vocab must be"):
        EagleDrafter(str(folder), draft_vocab=-2)
