"""Report arithmetic on synthetic records, every expected value computed by hand."""

import pytest

from specdraft.bench.report import (
    accept_length_histogram,
    greedy_equal,
    mbsu,
    measured_cost_ratio,
    metrics,
    render_markdown,
    summarize,
)

REQUIRED = {"block_efficiency", "acceptance_rate", "tokens_per_second", "speedup", "mbsu", "greedy_equal",
            "num_draft_tokens", "n"}
GREEDY_RUN = {"config": {"target": "t", "dtype": "float32", "temperature": 0.0, "top_k": 0, "top_p": 1.0,
                         "max_new_tokens": 16, "num_draft_tokens": 3, "repeats": 1},
              "environment": {"versions": {"torch": "x"}, "hardware": {"cpu": "c", "threads": 2}}}
SAMPLED_RUN = {**GREEDY_RUN, "config": {**GREEDY_RUN["config"], "temperature": 0.7}}


def rec(qid, model, subtask, tokens, wall, steps=None, proposed=None, accepted=None, draft_s=None, verify_s=None,
        ids=None, gamma=None, param_ratio=None, acc_pos=None, reached_pos=None, lengths=None, repeat=0):
    """One answer record with per-turn lists (None: not measured)."""
    return {
        "question_id": qid, "category": subtask, "subtask": subtask, "model_id": model, "method": model.split("@")[0],
        "repeat": repeat, "num_draft_tokens": gamma, "param_ratio": param_ratio,
        "choices": [{"index": 0, "turns": ["x"] * len(tokens), "new_tokens": tokens, "wall_time": wall,
                     "decoding_steps": steps, "draft_tokens_proposed": proposed, "draft_tokens_accepted": accepted,
                     "draft_seconds": draft_s, "verify_seconds": verify_s,
                     "token_ids": ids if ids is not None else [[7] * t for t in tokens],
                     "accepted_per_position": acc_pos, "reached_per_position": reached_pos,
                     "accept_lengths": lengths}],
    }


def ar_records():
    # q1 (mt_bench, 2 turns): 16 tokens in 2 s; q2 (qa): 8 tokens in 2 s.  ar: 24 tokens / 4 s = 6 tokens/s
    return [rec(1, "ar", "mt_bench", [10, 6], [1.0, 1.0], [10, 6], [0, 0], [0, 0], [0.0, 0.0], [0.9, 0.9]),
            rec(2, "ar", "qa", [8], [2.0], [8], [0], [0], [0.0], [1.8])]


def draft_records(ids_q2=None):
    # γ = 3.  q1: 16 tokens in 1 s over 7 steps; q2: 8 tokens in 0.5 s over 4 steps.
    return [
        rec(1, "draft", "mt_bench", [10, 6], [0.5, 0.5], [4, 3], [12, 9], [6, 3], [0.05, 0.05], [0.2, 0.2],
            gamma=3, param_ratio=0.1, acc_pos=[[3, 2, 1], [2, 1, 0]], reached_pos=[[4, 3, 2], [3, 2, 1]],
            lengths=[3, 3, 2, 2, 2, 2, 2]),
        rec(2, "draft", "qa", [8], [0.5], [4], [12], [4], [0.1], [0.4], ids=ids_q2, gamma=3, param_ratio=0.1,
            acc_pos=[[2, 1, 1]], reached_pos=[[4, 2, 1]], lengths=[2, 2, 2, 2]),
    ]


def test_metrics_overall_hand_computed():
    m = metrics(draft_records(), ar_records(), greedy=True)
    assert m["block_efficiency"] == pytest.approx(24 / 11)
    assert m["acceptance_rate"] == pytest.approx(13 / 33)
    assert m["tokens_per_second"] == pytest.approx(24 / 1.5)  # 16
    assert m["speedup"] == pytest.approx(16 / 6)
    # c = (0.2 s / 33 draft tokens) / (0.8 s / 11 forwards) = 1/12; mbsu = τ / (3 c + 1)
    assert measured_cost_ratio(draft_records()) == pytest.approx(1 / 12)
    assert m["mbsu"] == pytest.approx((24 / 11) / 1.25)
    assert m["mbsu_param_ratio"] == pytest.approx((24 / 11) / (3 * 0.1 + 1))
    assert m["acceptance_rate_per_position"] == pytest.approx([7 / 11, 4 / 7, 2 / 4])
    assert m["accept_length_histogram"] == [0, 0, 9, 2]
    assert m["greedy_equal"] is True
    assert m["num_draft_tokens"] == 3 and m["n"] == 2
    assert m["draft_seconds"] == pytest.approx(0.2) and m["verify_seconds"] == pytest.approx(0.8)
    assert m["overhead_seconds"] == pytest.approx(1.5 - 0.2 - 0.8)


def test_baseline_metrics():
    m = metrics(ar_records(), ar_records(), greedy=True)
    assert m["block_efficiency"] == 1.0 and m["speedup"] == 1.0 and m["mbsu"] == 1.0
    assert m["acceptance_rate"] is None and m["num_draft_tokens"] is None
    assert m["tokens_per_second"] == pytest.approx(6.0)


def test_summary_per_subtask_and_shape():
    summary = summarize(ar_records() + draft_records(), GREEDY_RUN)
    assert set(summary) == {"setup", "methods"}
    assert list(summary["methods"]) == ["ar", "draft"]
    for m in summary["methods"].values():
        assert set(m) == {"overall", "subtasks"}
        assert set(m["subtasks"]) == {"mt_bench", "qa"}
        for metrics_ in [m["overall"], *m["subtasks"].values()]:
            assert REQUIRED <= set(metrics_)
    sub = summary["methods"]["draft"]["subtasks"]
    assert sub["mt_bench"]["speedup"] == pytest.approx(16 / 8)  # 16 tok/s vs ar's 16 tok / 2 s
    assert sub["qa"]["speedup"] == pytest.approx(16 / 4)  # 8 tok / 0.5 s vs 8 tok / 2 s
    assert sub["mt_bench"]["block_efficiency"] == pytest.approx(16 / 7)
    assert sub["qa"]["acceptance_rate"] == pytest.approx(4 / 12)
    assert sub["qa"]["n"] == 1
    setup = summary["setup"]
    assert setup["sampling"]["greedy"] is True and setup["versions"] == {"torch": "x"}
    assert setup["hardware"]["threads"] == 2 and setup["dtype"] == "float32"


def test_greedy_equal_false_and_null():
    records = draft_records(ids_q2=[[7] * 7 + [8]])  # last token of q2 differs from ar's
    m = metrics(records, ar_records(), greedy=True)
    assert m["greedy_equal"] is False and m["greedy_equal_answers"] == {"equal": 1, "compared": 2}
    assert m["greedy_prefix_agreement"] == pytest.approx((16 + 7) / 24)  # q2 agrees up to its 8th token
    assert metrics(draft_records(), ar_records(), greedy=True)["greedy_prefix_agreement"] == 1.0
    assert metrics(records, ar_records(), greedy=False)["greedy_prefix_agreement"] is None
    summary = summarize(ar_records() + records, GREEDY_RUN)["methods"]["draft"]
    assert summary["subtasks"]["mt_bench"]["greedy_equal"] is True
    assert summary["subtasks"]["qa"]["greedy_equal"] is False
    assert greedy_equal(draft_records(), ar_records(), greedy=False) is None  # sampling
    no_ids = [rec(1, "hf", "mt_bench", [10, 6], [1.0, 1.0])]
    no_ids[0]["choices"][0]["token_ids"] = None
    assert greedy_equal(no_ids, ar_records(), greedy=True) is None
    assert summarize(ar_records() + draft_records(), SAMPLED_RUN)["methods"]["draft"]["overall"]["greedy_equal"] \
        is None


def test_speedup_uses_common_questions_and_median_of_repeats():
    # only q2 answered, three repeats at 0.5 s, 3 s, 1 s: the median (1 s) counts -> 8 tok/s vs ar's 4 tok/s on q2
    records = [rec(2, "m", "qa", [8], [w], repeat=r) for r, w in enumerate([0.5, 3.0, 1.0])]
    m = metrics(records, ar_records(), greedy=True)
    assert m["speedup"] == pytest.approx(2.0)
    assert m["tokens_per_second"] == pytest.approx(8.0)
    assert m["n"] == 1 and m["n_records"] == 3
    assert metrics(records, [], greedy=True)["speedup"] is None


def test_decode_only_speedup_takes_the_prefill_out_of_both_wall_times():
    def with_prefill(record, prefill):
        record["choices"][0]["prefill_seconds"] = prefill
        return record

    # ar: q1 2 s with 0.5 s of prefill, q2 2 s with 1.0 s -> 24 tokens / 2.5 s decoding
    ar = [with_prefill(r, p) for r, p in zip(ar_records(), [[0.25, 0.25], [1.0]], strict=True)]
    # draft: q1 1 s with 0.2 s prefill, q2 0.5 s with 0.05 s -> 24 tokens / 1.25 s decoding
    draft = [with_prefill(r, p) for r, p in zip(draft_records(), [[0.1, 0.1], [0.05]], strict=True)]
    m = metrics(draft, ar, greedy=True)
    assert m["speedup"] == pytest.approx(16 / 6)
    assert m["decode_speedup"] == pytest.approx((24 / 1.25) / (24 / 2.5))
    assert m["prefill_seconds"] == pytest.approx(0.25)
    assert m["overhead_seconds"] == pytest.approx(1.5 - 0.25 - 0.2 - 0.8)
    assert metrics(draft_records(), ar, greedy=True)["decode_speedup"] is None  # no prefill recorded
    assert "decode-only speed-up" in render_markdown(summarize(ar + draft, GREEDY_RUN))


def test_unmeasured_quantities_are_null():
    hf = [rec(1, "hf-assisted:d", "mt_bench", [10, 6], [2.0, 2.0], steps=[5, 3], gamma=4, param_ratio=0.25)]
    m = metrics(hf, ar_records(), greedy=True)
    assert m["block_efficiency"] == pytest.approx(2.0)
    assert m["acceptance_rate"] is None and m["mbsu"] is None  # no draft/verify ledger
    assert m["mbsu_param_ratio"] == pytest.approx(2.0 / (4 * 0.25 + 1))
    assert m["accept_length_histogram"] is None and m["acceptance_rate_per_position"] is None
    plain = [rec(1, "hf", "mt_bench", [10, 6], [2.0, 2.0])]
    assert metrics(plain, ar_records(), greedy=True)["block_efficiency"] is None


@pytest.mark.parametrize("tau, gamma, c, expected", [
    (2.0, None, None, 2.0), (2.0, 0, 5.0, 2.0), (3.0, 4, 0.0, 3.0), (3.0, 4, 0.5, 1.0), (3.0, 4, None, None),
    (None, 4, 0.5, None),
])
def test_mbsu_formula(tau, gamma, c, expected):
    assert mbsu(tau, gamma, c) == (pytest.approx(expected) if expected is not None else None)


def test_accept_length_histogram_counts():
    assert accept_length_histogram([rec(1, "m", "qa", [6], [1.0], lengths=[1, 3, 1, 1])]) == [0, 3, 0, 1]


def test_best_num_draft_tokens_and_markdown():
    fast = [rec(q, "pl@γ=2", s, [8], [0.5], [4], [8], [4], [0.01], [0.4], gamma=2, param_ratio=0.0)
            for q, s in ((1, "mt_bench"), (2, "qa"))]
    slow = [rec(q, "pl@γ=4", s, [8], [1.0], [3], [12], [5], [0.01], [0.4], gamma=4, param_ratio=0.0)
            for q, s in ((1, "mt_bench"), (2, "qa"))]
    summary = summarize(ar_records() + slow + fast, GREEDY_RUN)
    assert [summary["methods"][n]["overall"]["best_num_draft_tokens"] for n in ("pl@γ=2", "pl@γ=4")] == [2, 2]
    assert "best_num_draft_tokens" not in summary["methods"]["ar"]["overall"]
    assert summary["methods"]["pl@γ=2"]["overall"]["mbsu_param_ratio"] == pytest.approx(2.0)  # c = 0: τ
    text = render_markdown(summary)
    assert "| method | γ | n | τ |" in text and "| pl@γ=2 | 2 | 2 | 2.00 |" in text
    # greedy equal, with the count of equal answers: q1's pl answer (8 tokens) differs from ar's (10 + 6)
    # and the share of ar's tokens (8 + 8 of 24) they match before the first difference
    assert text.count("| yes (2/2) |") == 1 and text.count("| no (1/2; prefix 0.67) |") == 2
    assert "| pl | 2 |" in text  # best γ table
    assert "| ar | 1.00x | 1.00x | 1.00x |" in text  # speed-up by subtask: mt_bench, qa, overall


def test_acceptance_per_position_and_verified_draft_lengths_are_reported():
    """Draft-length counts add up per position over turns; the markdown shows them beside the acceptance per
    position; records without the field (older runs, other engines) report none."""
    records = draft_records()
    records[0]["choices"][0]["draft_length_counts"] = [[1, 0, 1, 2], [0, 1, 2]]  # turn 1: 4 steps, turn 2: 3 steps
    records[1]["choices"][0]["draft_length_counts"] = [[0, 0, 4]]
    m = metrics(records, ar_records(), greedy=True)
    assert m["draft_length_counts"] == [1, 1, 7, 2]
    assert metrics(draft_records(), ar_records(), greedy=True)["draft_length_counts"] is None
    text = render_markdown(summarize(ar_records() + records, GREEDY_RUN))
    assert "## Acceptance per draft position and verified draft lengths" in text
    assert "- draft: acceptance per position 0.64 / 0.57 / 0.50; drafts verified (tokens: share of steps) " \
           "0: 9%, 1: 9%, 2: 64%, 3: 18%" in text
