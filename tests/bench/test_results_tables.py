"""benchmarks/results_tables.py rebuilds the report's tables from run folders: bench summaries and training logs."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "results_tables.py"


@pytest.fixture(scope="module")
def tables():
    spec = importlib.util.spec_from_file_location("results_tables", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["results_tables"] = module  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("results_tables", None)


def _metrics(tau, speedup, equal=None):
    return {"block_efficiency": tau, "tokens_per_second": 10.0 * speedup, "speedup": speedup,
            "decode_speedup": speedup + 0.1, "acceptance_rate_per_position": [0.5, 0.25, 0.125, 1.0, 0.0],
            "greedy_equal_answers": {"equal": equal, "compared": 18} if equal is not None else None, "n": 18}


def _bench_run(folder: Path, methods: dict) -> None:
    folder.mkdir(parents=True)
    summary = {"setup": {"dtype": "bfloat16", "sampling": {"greedy": True, "temperature": 0.0}, "max_new_tokens": 64,
                         "questions": "q.jsonl", "per_category": 3},
               "methods": {name: {"overall": m, "subtasks": {"qa": m, "translation": m}}
                           for name, m in methods.items()}}
    (folder / "summary.json").write_text(json.dumps(summary))


def test_a_bench_table_has_the_reports_rows_and_columns(tables, tmp_path):
    _bench_run(tmp_path / "bench9-1024", {"ar": _metrics(1.0, 1.0), "draft:smollm2-135m-instruct-drafter":
                                          _metrics(3.52, 2.73, 7), "prompt-lookup": _metrics(3.29, 2.79, 6)})
    text = tables.report(tmp_path, replay=False, only="specbench-1024-bf16")
    assert "| shipped drafter, default options | 3.52 | 0.50, 0.25, 0.12, 1.00 | 27.3 | 2.73x | 2.83x | 7/18 |" in text
    assert "| prompt lookup alone | 3.29 |" in text
    assert "(missing: hf-assisted:smollm2-135m-instruct-drafter)" in text  # a method the run lacks is named


def test_a_subtask_table_and_a_missing_run(tables, tmp_path):
    _bench_run(tmp_path / "quiet", {"ar": _metrics(1.0, 1.0), "rest": _metrics(1.36, 0.9)})
    text = tables.report(tmp_path, replay=False, only="training-free")
    assert "| method | translation | qa | overall |" in text
    assert "| REST | 1.36 | 1.36 | 1.36 |" in text
    assert "(missing:" in tables.report(tmp_path, replay=False, only="length-64")


def test_a_training_table_reads_the_last_evaluation(tables, tmp_path):
    folder = tmp_path / "ft-l01-tasks"
    folder.mkdir()
    (folder / "eval_log.csv").write_text("step,heldout_tvd,heldout_coverage,block_efficiency@3,block_efficiency@5\n"
                                         "600,0.6,0.91,1.7,1.8\n1200,0.5726,0.9144,1.766,1.925\n")
    text = tables.report(tmp_path, replay=False, only="shipped-drafter-heldout")
    assert "| stage (c), pooled (the shipped drafter) | 1200 | 0.573 | 0.914 | 1.766 | 1.925 |" in text
    assert "| stage (c), ShareGPT answers | (missing: ft-l01-fkl) |" in text


def test_every_report_table_has_a_unique_name(tables, tmp_path):
    names = [spec.name for spec in tables.REPORT]
    assert len(names) == len(set(names)) > 10
    with pytest.raises(ValueError, match="no table named"):
        tables.report(tmp_path, replay=False, only="no-such-table")
