"""FR-Spec draft vocabularies (Zhao et al. 2025, arXiv 2502.14856; ``specdraft.draft_vocab``): the frequency
ranking, its file and its errors, and the subset logits. Drafting with a subset: tests/heads/test_vocab.py."""

import pytest
import torch

from specdraft.draft_vocab import RANKING_FILE, DraftVocab, draft_subset, load_token_ranking, rank_tokens
from specdraft.errors import SpecdraftError


def test_rank_tokens_orders_by_count_then_id():
    ranking = rank_tokens([[5, 5, 7], [7, 5, 2], []], 8)
    assert ranking.tolist() == [5, 7, 2, 0, 1, 3, 4, 6]


def test_ranking_file_round_trip_and_errors(tmp_path):
    from specdraft.draft_vocab import save_token_ranking

    ranking = rank_tokens([[3, 3, 1]], 6)
    save_token_ranking(tmp_path, ranking)
    assert torch.equal(load_token_ranking(tmp_path, 6), ranking)
    with pytest.raises(SpecdraftError, match="not a ranking of the 7-token"):
        load_token_ranking(tmp_path, 7)
    save_token_ranking(tmp_path, torch.tensor([0, 0, 1, 2, 3, 4]))
    with pytest.raises(SpecdraftError, match="not a ranking"):
        load_token_ranking(tmp_path, 6)
    (tmp_path / RANKING_FILE).write_bytes(b"garbage")
    with pytest.raises(SpecdraftError, match="corrupt token ranking"):
        load_token_ranking(tmp_path, 6)
    with pytest.raises(SpecdraftError, match="has no token_ranking"):
        draft_subset(tmp_path / "empty", 6, 3)
    with pytest.raises(SpecdraftError, match="draft_vocab must be"):
        draft_subset(tmp_path, 6, -1)
    assert draft_subset(tmp_path / "empty", 6, 0) is None and draft_subset(tmp_path / "empty", 6, 6) is None


def test_subset_logits_equal_the_full_ones_inside_and_are_minus_inf_outside():
    lm_head, features = torch.randn(50, 8), torch.randn(3, 8)  # (V, D), (B, D)
    keep = torch.tensor([4, 17, 0, 33])
    full = DraftVocab(lm_head).logits(features)  # (B, V)
    sub = DraftVocab(lm_head, keep).logits(features)  # (B, V)
    torch.testing.assert_close(sub[:, keep], full[:, keep])
    outside = torch.ones(50, dtype=torch.bool)
    outside[keep] = False
    assert torch.isneginf(sub[:, outside]).all()
    assert DraftVocab(lm_head, torch.arange(50)).keep is None  # the whole vocabulary: no restriction


def test_int8_rows_round_the_draft_logits_only_slightly():
    from specdraft.models import quantized

    if not quantized.available():
        pytest.skip("specdraft's int8 kernels do not run here")
    torch.manual_seed(0)
    weight, features = torch.randn(40, 64), torch.randn(3, 64)
    dense = DraftVocab(weight, torch.tensor([1, 5, 9])).logits(features)
    rounded = DraftVocab(weight, torch.tensor([1, 5, 9]), quantize="int8")
    assert rounded.packed is not None
    got = rounded.logits(features)  # (3, 40), -inf outside the subset
    assert torch.equal(torch.isinf(got), torch.isinf(dense))
    finite = torch.isfinite(dense)
    torch.testing.assert_close(got[finite], dense[finite], atol=0.2, rtol=0.02)
    assert not torch.equal(got[finite], dense[finite])
