"""benchmarks/heldout_tvd.py: the exact greedy block efficiency of a drafter from teacher-forced matches."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "heldout_tvd.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("heldout_tvd", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["heldout_tvd"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("heldout_tvd", None)


@pytest.mark.parametrize(("matches", "gamma", "expected"), [
    ([], 3, (0, 0, 0)),
    ([False] * 4, 3, (4, 4, 0)),  # every block: no draft accepted, the target's token only
    ([True] * 8, 3, (8, 2, 2)),  # 3 accepted + bonus, twice
    ([True, True, False, True, False], 4, (5, 2, 2)),  # block 1: 2 accepted + recovered; block 2: 1 + recovered
    ([True, True, True], 4, (3, 1, 1)),  # the response ends inside the block
    ([False, True, True, True, True, True], 2, (6, 3, 2)),  # recovered, then 2 + bonus, then 2 and the end
])
def test_greedy_blocks(script, matches, gamma, expected):
    assert script.greedy_blocks(matches, gamma) == expected


@pytest.mark.parametrize(("matches", "siblings", "gamma", "expected"), [
    ([False, True, False, False], [True, False, False, True], 3, (4, 3, 2)),  # sibling + bonus, recovered, sibling
    ([True, True, True, False], [False, False, False, True], 3, (4, 1, 1)),  # a full chain: no sibling past γ
    ([True, False, False], [False, False, False], 2, (3, 2, 1)),  # no sibling hit: the chain's blocks
])
def test_greedy_blocks_with_siblings(script, matches, siblings, gamma, expected):
    assert script.greedy_blocks(matches, gamma, siblings) == expected


def test_greedy_tau_pools_over_responses(script):
    row = script.greedy_tau([[0] * 4, [5] * 2], [3])
    assert row["greedy_tau@3"] == pytest.approx(6 / 3)  # (4 tokens in 1 block) + (2 tokens in 2 blocks)
    assert row["greedy_first_accept@3"] == pytest.approx(1 / 3)
    row = script.greedy_tau([[0, 1, 0, 2, 3]], [2], siblings=[1, 2])
    assert row["greedy_tau@2"] == pytest.approx(5 / 3)  # 1 + recovered, 1 + recovered, recovered
    assert row["greedy_tau@2+1"] == pytest.approx(5 / 3)  # chain + rank-1 sibling + bonus, recovered, recovered
    assert row["greedy_tau@2+2"] == pytest.approx(5 / 2)  # the same, then the rank-2 sibling + the end


def test_copy_hits_read_the_continuation_of_the_longest_earlier_match(script):
    records = [{"prompt_token_ids": [5, 6, 7, 8, 5], "response_token_ids": [6, 9, 5, 6, 7, 1]}]
    # t=0: "8 5"? no 2-gram seen; t=1: "5 6" seen -> 7 (wrong, 9); t=2: "6 9" unseen; t=3: "9 5" unseen;
    # t=4: "5 6" -> most recent continuation 9 (wrong, 7); t=5: "5 6 7" seen -> 8 (wrong, 1)
    assert script.copy_hits(records, 2) == [[-1, 0, -1, -1, 0, 0]]
    records = [{"prompt_token_ids": [1, 2, 3, 1, 2], "response_token_ids": [3, 1, 2, 3]}]
    assert script.copy_hits(records, 2) == [[1, 1, 1, 1]]
    assert script.copy_hits(records, 3) == [[-1, 1, 1, 1]]  # "1 2" alone is too short at t = 0


def test_greedy_tau_with_chain_copies_takes_the_copy_where_there_is_one(script):
    ranks, hits = [[0, 3, 3, 0, 3]], [[-1, 1, 0, -1, -1]]  # model, copy right, copy wrong, model, model wrong
    row = script.greedy_tau(ranks, [4], copies={2: hits})
    assert row["greedy_tau@4:copy2"] == pytest.approx(5 / 2)  # 2 accepted + recovered, 1 accepted + recovered
    assert row["greedy_first_accept@4:copy2"] == pytest.approx(1.0)
    assert row["greedy_tau@4"] == pytest.approx(5 / 3)  # without copies: 1 + recovered, recovered, 1 + recovered
