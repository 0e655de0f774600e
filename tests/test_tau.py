"""Greedy speculative decoding replayed over a known answer (specdraft.tau): the walk, by hand."""

import pytest

from specdraft.tau import FIRST_ACCEPT, TAU, greedy_steps, leading, metric, tally


@pytest.mark.parametrize("accepted, length, expected", [
    ({}, 3, [(0, 1), (0, 1), (0, 1)]),  # nothing accepted: a plain step per token
    ({0: 2, 3: 1}, 5, [(2, 3), (1, 2)]),  # 2 accepted + the target's, then 1 + the target's
    ({0: 4}, 3, [(3, 3)]),  # never past the end: the last accepted token ends the answer, no bonus
    ({0: 2}, 3, [(2, 3)]),  # all but the last: the target's own token is the last one
    ({0: 1, 2: 7}, 4, [(1, 2), (2, 2)]),
    ({}, 0, []),
])
def test_greedy_steps_by_hand(accepted, length, expected):
    steps = greedy_steps(lambda t: accepted.get(t, 0), length)
    assert steps == expected
    assert sum(c for _, c in steps) == length


def test_the_walk_asks_only_where_a_step_starts():
    asked = []
    greedy_steps(lambda t: asked.append(t) or 2, 8)
    assert asked == [0, 3, 6]


def test_leading_tally_and_names():
    assert leading([True, True, False, True], 4) == 2 and leading([True] * 5, 3) == 3 and leading([], 2) == 0
    assert tally([(2, 3), (0, 1), (1, 1)]) == (5, 3, 2)
    assert metric(TAU, 4) == "greedy_tau@4" and metric(FIRST_ACCEPT, 3, ":copy2") == "greedy_first_accept@3:copy2"
