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
