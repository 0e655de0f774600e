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


def _scan(context: torch.Tensor, n_max: int, n_min: int, k: int) -> tuple[int, list[int]]:
    """The definition: the most recent earlier occurrence of the longest matching n-gram, by scanning."""
    length = context.shape[0]
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        hits = (context[: length - 1].unfold(0, n, 1) == context[length - n :]).all(-1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return n, context[start : start + k].tolist()
    return 0, []


def test_the_incremental_index_matches_a_scan_as_contexts_grow_roll_back_and_change():
    """One drafter follows a context that grows by accepted tokens, loses rejected ones, and is replaced outright
    (a new prompt): every match equals a scan of that context."""
    import random

    rng = random.Random(0)
    for n_max, n_min in ((3, 1), (4, 2), (1, 1)):
        drafter = PromptLookupDrafter(n_max, n_min)
        context = [rng.randrange(5) for _ in range(12)]
        for _ in range(150):
            roll = rng.random()
            if roll < 0.55:
                context = context + [rng.randrange(5) for _ in range(rng.randint(0, 4))]
            elif roll < 0.9:
                context = context[: max(1, len(context) - rng.randint(1, 5))] + [rng.randrange(5)]
            else:
                context = [rng.randrange(5) for _ in range(rng.randint(1, 20))]
            k = rng.randint(1, 5)
            size, draft = drafter.match(torch.tensor(context), k)
            assert (size, draft.tokens.tolist()) == _scan(torch.tensor(context), n_max, n_min, k)


def test_a_context_changed_in_place_is_indexed_again():
    """A step asks twice about one context (its kind, then its draft) and the second ask reuses the index; the same
    tensor changed in place since (same length) is a new context and matches as a fresh drafter's would."""
    drafter = PromptLookupDrafter(3, 1)
    context = torch.tensor([1, 2, 3, 4, 9, 9, 1, 2, 3])
    assert drafter.match(context, 2)[1].tokens.tolist() == [4, 9]
    assert drafter.match(context, 3)[1].tokens.tolist() == [4, 9, 9]
    context[3] = 7  # the buffer reused for another context of the same length
    assert drafter.match(context, 2)[1].tokens.tolist() == _scan(context, 3, 1, 2)[1] == [7, 9]
