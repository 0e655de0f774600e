"""benchmarks/gpu_recipe.py --tiny on a toy target with every default phase (the float32 check, the data engine's
timing with its ledger and profile, data, both drafter lines, EAGLE-3 heads, exact τ): minutes of CPU, so slow;
the default suite runs the device path with the data, drafter and τ phases (test_gpu_device.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from toys import save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_every_default_phase_runs_at_toy_sizes_and_reports(tmp_path):
    from specdraft.cli import main

    save_tiny_checkpoint(tmp_path / "target", seed=0, layers=4, hidden=32)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"w{i} w{i + 7} w3"}) + "\n"
                                                    for i in range(40)))
    (tmp_path / "question.jsonl").write_text("".join(json.dumps({"turns": [f"w{i} w5"]}) + "\n" for i in range(8)))
    assert main(["init-drafter", "--target", str(tmp_path / "target"), "--layers", "0", "--out",
                 str(tmp_path / "shipped")]) == 0
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_recipe.py"), "--target",
                          str(tmp_path / "target"), "--prompts", str(tmp_path / "prompts.jsonl"), "--questions",
                          str(tmp_path / "question.jsonl"), "--out", str(out), "--work", str(tmp_path / "work"),
                          "--tiny", "--device", "cpu", "--shipped", str(tmp_path / "shipped"), "--budget", "5000",
                          "--pack", str(tmp_path / "packed")], capture_output=True, text=True, timeout=1800,
                         env=os.environ | {"PYTHONPATH": str(ROOT / "src")})
    assert run.returncode == 0, run.stdout[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert all(r["status"] == "ok" for r in summary["phases"].values()), summary["phases"]
    verdicts = summary["verdicts"]
    assert verdicts["float32_answers_equal_to_transformers"] == "4/4" and verdicts["float32_refill_answers_equal"]
    assert summary["bench-native"] and all(r["ledger"]["steps"] > 0 for r in summary["bench-native"])
    assert "top operators by host time" in (out / "profile-static-4.txt").read_text()
    assert summary["curves"]["eagle3"] and (out / "exports" / "eagle3-heads" / "heads.json").is_file()
    assert verdicts["best_line"] in ("shipped", "copy") and verdicts["recipe_seconds_prompts_to_exports"] > 0
    assert len(list((tmp_path / "packed").iterdir())) <= 8
