import pytest
import torch

from specdraft.drafters import PromptLookupDrafter
from specdraft.errors import SpecdraftError
from specdraft.sampling import SamplingConfig

GREEDY = SamplingConfig()


def _propose(context, k=4, **kwargs):
    draft = PromptLookupDrafter(**kwargs).propose(torch.tensor(context), k, GREEDY, None)
    assert draft.q is None  # deterministic: verified as a point mass
    return draft.tokens.tolist()


def test_copies_continuation_of_longest_ngram():
    #           0  1  2  3  4  5  6  7  8  9
    context = [7, 1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert _propose(context) == [4, 5, 9, 1]


def test_prefers_longer_ngram_over_more_recent_shorter_one():
    context = [1, 2, 3, 8, 8, 9, 3, 6, 1, 2, 3]  # "1 2 3" -> 8; the later "3" alone -> 6
    assert _propose(context, 2) == [8, 8]
    assert _propose(context, 2, max_ngram_size=1) == [6, 1]  # unigrams only: the most recent "3" is at index 6


def test_most_recent_match_and_truncation_at_context_end():
    context = [4, 5, 1, 4, 5, 2, 4, 5]
    assert _propose(context, 3) == [2, 4, 5]  # most recent "4 5" is at index 3
    assert _propose([4, 5, 6, 4, 5], 5) == [6, 4, 5]  # continuation runs into the suffix and stops at the end


def test_no_match_gives_empty_draft():
    assert _propose([1, 2, 3, 4]) == []
    assert _propose([1]) == []
    assert _propose([1, 2, 3, 1], min_ngram_size=2) == []


def test_draft_kind_is_the_matched_ngram_size():
    drafter = PromptLookupDrafter()
    assert drafter.draft_kind(torch.tensor([7, 1, 2, 3, 4, 5, 9, 1, 2, 3]), GREEDY) == 3
    assert drafter.draft_kind(torch.tensor([4, 5, 1, 4, 5, 2, 8, 5]), GREEDY) == 1
    assert drafter.draft_kind(torch.tensor([1, 2, 3, 4]), GREEDY) == 0


def test_bad_ngram_sizes():
    with pytest.raises(SpecdraftError, match="ngram"):
        PromptLookupDrafter(max_ngram_size=1, min_ngram_size=2)
