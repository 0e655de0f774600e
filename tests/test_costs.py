"""The machine's cost model: measured on a toy model, cached per model and machine, rewritten when corrupt."""

import json

from specdraft.costs import CostCurve, cost_curve, curve_path, describe, machine, measure, monotone
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
    assert curve.table == monotone(curve.table)


def test_a_point_dearer_than_a_larger_one_is_lowered_to_it() -> None:
    """Noise only adds time: a 3-token forward measured dearer than the 4-token one, or than itself after more
    cached tokens, takes the larger point's time; a monotone table is left as it is."""
    noisy = ((1.0, 1.32, 1.13, 1.5), (1.2, 1.1, 1.4, 1.6))  # contexts (short, long) x sizes (1, 2, 3, 4)
    assert monotone(noisy) == ((1.0, 1.1, 1.13, 1.5), (1.1, 1.1, 1.4, 1.6))
    clean = ((1.0, 1.1, 1.2), (1.5, 1.6, 1.9))
    assert monotone(clean) == clean


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
