import torch

from specdraft.drafters import DraftModelDrafter
from specdraft.sampling import SamplingConfig
from toys import hf_target


def test_cached_proposals_equal_fresh_proposals_after_rollbacks():
    """The drafter's cache, synchronised by common prefix, must give what a drafter with no history gives."""
    draft_model = hf_target(1)
    drafter = DraftModelDrafter(draft_model)
    generator = torch.Generator().manual_seed(0)
    context = torch.tensor([3, 4, 5, 6])
    for step in range(12):
        draft = drafter.propose(context, 4, SamplingConfig(), None).tokens
        fresh = DraftModelDrafter(draft_model).propose(context, 4, SamplingConfig(), None).tokens
        assert torch.equal(draft, fresh), step
        keep = step % 5  # accept a varying prefix, then a "recovered" token the draft did not propose
        recovered = torch.randint(0, 64, (1,), generator=generator)
        context = torch.cat([context, draft[:keep], recovered])


def test_sampled_draft_returns_warped_q_rows():
    drafter = DraftModelDrafter(hf_target(1))
    sampling = SamplingConfig(0.8, top_k=5)
    draft = drafter.propose(torch.tensor([3, 4, 5]), 3, sampling, torch.Generator().manual_seed(0))
    assert draft.q is not None and draft.q.shape == (3, 64)
    assert torch.allclose(draft.q.sum(-1), torch.ones(3))
    assert ((draft.q > 0).sum(-1) <= 5).all()
    assert (draft.q[torch.arange(3), draft.tokens] > 0).all()  # each token was drawn from its q row


def test_greedy_draft_is_deterministic_with_no_q():
    drafter = DraftModelDrafter(hf_target(1))
    draft = drafter.propose(torch.tensor([3, 4, 5]), 3, SamplingConfig(), None)
    assert draft.q is None and len(draft) == 3


def test_cache_grows_for_long_contexts():
    drafter = DraftModelDrafter(hf_target(1, max_positions=2048))
    short = drafter.propose(torch.tensor([3, 4]), 2, SamplingConfig(), None).tokens
    long_context = torch.arange(300) % 60
    tokens = drafter.propose(long_context, 3, SamplingConfig(), None).tokens
    assert torch.equal(tokens, DraftModelDrafter(drafter.model).propose(long_context, 3, SamplingConfig(), None).tokens)
    assert short.shape == (2,)
