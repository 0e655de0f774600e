"""The machine's cost model: measured on a toy model, cached per model and machine, rewritten when corrupt."""

import json

from specdraft.costs import CostCurve, cost_curve, curve_path, describe, machine, measure
from specdraft.models.native_llama import NativeLlama
from toys import tiny_llama


def _toy(name: str = "toy-costs") -> NativeLlama:
    native = NativeLlama.from_hf(tiny_llama(0))
    native.name = name
    return native


def test_measure_covers_every_size_and_context() -> None:
    curve = measure(_toy(), sizes=(1, 2, 4), contexts=(8, 32), repeats=1)
    assert curve.sizes == (1, 2, 4) and curve.contexts == (8, 32)
    assert all(s > 0 for row in curve.table for s in row)
    assert curve.machine["isa"] == machine()["isa"] and curve.model["num_hidden_layers"] == 2
    assert len(describe(curve)) == 2 + 3
    assert curve.clock == "cpu"  # one torch thread (conftest): CPU time, robust to other processes


def test_curve_is_cached_beside_the_checkpoints_and_reloaded(tmp_path) -> None:
    model = _toy("toy-cached")
    first = cost_curve(model, folder=tmp_path)
    path = curve_path(model, tmp_path)
    assert path.is_file() and not list(tmp_path.glob("*.partial"))
    assert CostCurve.from_dict(json.loads(path.read_text())) == first
    assert cost_curve(model, folder=tmp_path) is first  # from memory
    path.write_text("{not json")
    again = cost_curve(model, folder=tmp_path, refresh=True)  # a corrupt file is remeasured and replaced
    assert CostCurve.from_dict(json.loads(path.read_text())) == again


def test_another_dtype_or_machine_gets_another_file(tmp_path, monkeypatch) -> None:
    model = _toy("toy-key")
    path = curve_path(model, tmp_path)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert curve_path(model, tmp_path) != path
