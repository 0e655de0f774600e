"""benchmarks/static_schedule.py: replaying the static engine's schedule from answer lengths alone counts exactly the
rows the real engine decodes and the steps it takes (a toy target, float32, on the CPU)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from specdraft.models.registry import load_model
from specdraft.models.static_batch import StaticBatch
from specdraft.sampling import SamplingConfig
from specdraft.training.data.native_generation import generate_rows_static
from toys import save_tiny_checkpoint

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "static_schedule.py"
PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [5, 6, 7], [20, 21], [30, 31, 32, 33], [40], [41, 42, 43, 44, 45, 46],
           [50], [51, 52]]


@pytest.mark.parametrize(("rows", "refill"), [(4, False), (3, True), (16, True)])
def test_the_replay_counts_what_the_engine_decodes(tmp_path, monkeypatch, rows, refill):
    spec = importlib.util.spec_from_file_location("static_schedule", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = load_model(str(save_tiny_checkpoint(tmp_path / "t", seed=0)), torch.float32, backend="native")
    steps = []
    decode = StaticBatch.decode
    monkeypatch.setattr(StaticBatch, "decode", lambda self, *a: steps.append(a[1]) or decode(self, *a))
    order = sorted(range(len(PROMPTS)), key=lambda i: len(PROMPTS[i]))  # distill-data's batching
    answers, decoded = [0] * len(PROMPTS), 0
    for start in range(0, len(order), len(order) if refill else rows):
        chosen = order[start : start + (len(order) if refill else rows)]
        batch = StaticBatch(model, rows if refill else len(chosen), 6 + 12)
        responses, count = generate_rows_static(batch, [PROMPTS[i] for i in chosen], 12, SamplingConfig(), 38, 0,
                                                None, rows=rows if refill else len(chosen))
        decoded += count
        for i, response in zip(chosen, responses, strict=True):
            answers[i] = len(response["ids"])
    assert min(answers) < 12 and 12 in answers  # rows end early and at the length cap
    counted = module.replay([len(p) for p in PROMPTS], answers, rows, refill, max_new_tokens=12)
    assert counted["rows_decoded"] == decoded and counted["steps"] == len(steps)
    assert counted["answer_tokens"] == sum(answers) and counted["prefill_tokens"] == sum(map(len, PROMPTS))
