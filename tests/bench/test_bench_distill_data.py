"""benchmarks/bench_distill_data.py on a tiny target: every engine answers the same prompts with the same greedy
tokens (float32) and reports its answer tokens/s, one JSON line per engine and batch size."""

import importlib.util
import json
import sys
from pathlib import Path

from toys import save_tiny_checkpoint

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_distill_data.py"


def test_every_engine_reports_its_rate_on_the_same_answers(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("bench_distill_data", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    target = save_tiny_checkpoint(tmp_path / "t", seed=0)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 3}"}) + "\n" for i in range(6)))
    out = tmp_path / "rows.jsonl"
    monkeypatch.setattr(sys, "argv", ["bench", "--target", str(target), "--prompts", str(prompts), "--limit", "6",
                                      "--engines", "native,static,hf", "--batch-sizes", "1,4", "--max-new-tokens", "5",
                                      "--dtype", "float32", "--device", "cpu", "--json-out", str(out), "--compare"])
    module.main()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    engines = [(e, b) for e in ("native", "static", "hf") for b in (1, 4)]
    assert [(r["engine"], r["batch_size"]) for r in rows] == engines
    assert len({r["answer_tokens"] for r in rows}) == 1 and all(r["answer_tokens_per_s"] > 0 for r in rows)
    assert all(r["same_answers_as_first_engine"] == 6 for r in rows)
    assert "answer tokens/s" in capsys.readouterr().out


def test_the_ledger_counts_the_static_engines_parts(tmp_path, monkeypatch):
    """--ledger: every prompt prefilled once, the rows decoded are those behind row_step_use, no graph on a CPU, and
    the parts' seconds within the run's."""
    spec = importlib.util.spec_from_file_location("bench_distill_data", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    target = save_tiny_checkpoint(tmp_path / "t", seed=0)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 3}" + " w9" * i}) + "\n" for i in range(6)))
    out = tmp_path / "rows.jsonl"
    monkeypatch.setattr(sys, "argv", ["bench", "--target", str(target), "--prompts", str(prompts), "--limit", "6",
                                      "--engines", "static,static-refill", "--batch-sizes", "4", "--max-new-tokens",
                                      "9", "--dtype", "float32", "--device", "cpu", "--json-out", str(out),
                                      "--ledger"])
    module.main()
    for row in (json.loads(line) for line in out.read_text().splitlines()):
        ledger = row["ledger"]
        assert ledger["prefill_prompts"] == 6 and ledger["graphs_captured"] == 0 and ledger["steps"] >= 8
        decoded = (row["answer_tokens"] - row["prompts"]) / row["row_step_use"]
        assert abs(ledger["rows_decoded"] - decoded) <= decoded * 0.01 + 1
        # seconds is rounded to 0.01 and other_s to 0.001: a part of the run's time, within the rounding
        assert ledger["slots_attended"] >= ledger["rows_decoded"] and 0 < ledger["other_s"] <= row["seconds"] + 0.005
    from specdraft.models.static_batch import StaticBatch

    assert StaticBatch.decode.__name__ == "decode" and StaticBatch.prefill.__qualname__ == "StaticBatch.prefill"
