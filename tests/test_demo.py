"""The demo on tiny checkpoints: every method answers, a drafter that cannot load is skipped with its reason."""

import pytest

from specdraft.demo import DemoConfig, run_demo
from specdraft.errors import SpecdraftError
from toys import save_tiny_checkpoint


def test_demo_runs_each_method_and_skips_what_cannot_load(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))  # no REST datastore there
    target = str(save_tiny_checkpoint(tmp_path / "target", seed=0))
    draft = str(save_tiny_checkpoint(tmp_path / "draft", seed=1, layers=1))
    lines: list[str] = []
    rows = run_demo(DemoConfig(target=target, draft=draft, num_prompts=2, max_new_tokens=8,
                               drafters=("prompt-lookup", "rest")), out=lines.append)
    assert [r["method"] for r in rows] == ["plain", f"draft:{draft}", "prompt-lookup"]
    assert all(r["identical"] == "2/2" for r in rows)  # fp32: speculative output equals plain decoding
    assert any(line.startswith("skipping rest: ") and "build-datastore" in line for line in lines)
    assert sum(line.startswith("  round 3/3, plain: prompt") for line in lines) == 2  # every round answers all
    assert any("medians of 3 rounds" in line for line in lines)
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("method")):][:4]
    assert len({len(line) for line in table}) == 1  # columns line up, even for a long draft path
    assert table[1].startswith(f"draft:{draft} ") or table[2].startswith(f"draft:{draft} ")
    with pytest.raises(SpecdraftError, match="unknown drafter 'nope'"):
        run_demo(DemoConfig(target=target, num_prompts=1, max_new_tokens=4, drafters=("nope",)), out=lines.append)


def test_why_not_faster_prices_a_step_in_plain_steps():
    from specdraft.costs import CostCurve
    from specdraft.demo import why_not_faster
    from specdraft.sequence import GenerationResult
    from specdraft.stats import GenerationStats

    plain = [GenerationResult([1] * 10, "length", GenerationStats(new_tokens=10, target_forward_calls=10,
                                                                  decode_seconds=1.0))]
    spec = [GenerationResult([1] * 10, "length", GenerationStats(new_tokens=10, target_forward_calls=8,
                                                                 draft_tokens_proposed=24, verify_seconds=1.6,
                                                                 draft_seconds=0.4, decode_seconds=2.0))]
    curve = CostCurve((1, 4), (64,), ((0.1, 0.3),), {"dtype": "float32"}, {"isa": "AVX2"})
    line = why_not_faster("x", spec, plain, curve)
    assert "commits 1.25 tokens" in line and "costs 2.50 plain steps" in line and "verifying 4.0 tokens 2.00" in line
    assert "calibrated 3.00x" in line and "AVX2" in line and "drafting 0.50" in line


def test_why_not_faster_prices_prefill_apart_from_the_steps():
    """Prefill is in decode_seconds but is no step: a plain step is (decode - prefill) / forwards, and the line says
    what share of the plain run the prefill took; the loop's time outside drafting and verifying is a cost too."""
    from specdraft.costs import CostCurve
    from specdraft.demo import why_not_faster
    from specdraft.sequence import GenerationResult
    from specdraft.stats import GenerationStats

    plain = [GenerationResult([1] * 10, "length", GenerationStats(new_tokens=10, target_forward_calls=10,
                                                                  prefill_seconds=0.25, decode_seconds=1.25))]
    spec = [GenerationResult([1] * 10, "length", GenerationStats(new_tokens=10, target_forward_calls=8,
                                                                 draft_tokens_proposed=8, verify_seconds=0.96,
                                                                 draft_seconds=0.16, prefill_seconds=0.25,
                                                                 decode_seconds=1.45))]
    curve = CostCurve((1, 4), (64,), ((0.1, 0.3),), {"dtype": "float32"}, {"isa": "AVX2"})
    line = why_not_faster("x", spec, plain, curve)
    assert "costs 1.50 plain steps" in line and "verifying 2.0 tokens 1.20" in line and "drafting 0.20" in line
    assert "the loop 0.10" in line and "prefill is 20% of plain decoding's time" in line


def test_demo_on_quantized_weights_checks_identity_in_the_same_run(tmp_path, monkeypatch):
    from specdraft.models import rowgemm

    if not rowgemm.available():
        pytest.skip("no AVX2/F16C CPU or C++ compiler for the int8 kernels")
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    target = str(save_tiny_checkpoint(tmp_path / "target", seed=0))
    draft = str(save_tiny_checkpoint(tmp_path / "draft", seed=1, layers=1))
    lines: list[str] = []
    rows = run_demo(DemoConfig(target=target, draft=draft, num_prompts=2, max_new_tokens=8, drafters=("prompt-lookup",),
                               quantize="int8"), out=lines.append)
    assert [r["method"] for r in rows] == ["plain", f"draft:{draft}", "prompt-lookup"]
    assert all(r["identical"] == "2/2" for r in rows)
    assert any("identical to plain: int8 blocks, this run" in line for line in lines)
    assert not any("float32 check" in line for line in lines)


def test_the_methods_answer_each_prompt_in_turn(monkeypatch):
    """The demo interleaves: every method answers a prompt before the next prompt, the order rotated per prompt."""
    from types import SimpleNamespace

    import specdraft.demo as demo

    calls = []

    caches = {}

    def fake_generate(target, ids, drafter, gen, generator, policy=None, prefix_cache=None):
        calls.append((ids, drafter))
        caches.setdefault(drafter, set()).add(id(prefix_cache))
        return SimpleNamespace(stats=SimpleNamespace(new_tokens=1, tokens_per_second=1.0, block_efficiency=1.0))

    monkeypatch.setattr(demo, "generate", fake_generate)
    monkeypatch.setattr(demo, "speculation_policy", lambda gen, target, drafter: None)
    methods = {"plain": "p", "a": "a", "b": "b"}
    results = demo._answer_all(None, methods, ["x", "y", "z"], None, lambda line: None)
    assert calls == [("x", "p"), ("x", "a"), ("x", "b"), ("y", "a"), ("y", "b"), ("y", "p"),
                     ("z", "b"), ("z", "p"), ("z", "a")]
    assert {name: len(rs) for name, rs in results.items()} == {"plain": 3, "a": 3, "b": 3}
    assert all(len(kept) == 1 for kept in caches.values()) and len(set.union(*caches.values())) == 3  # one a method


def test_the_table_gives_each_figures_median_over_the_rounds():
    from specdraft.demo import _median_row

    rows = [{"method": "m", "identical": "2/2", "tokens_per_second": t, "block_efficiency": b, "speedup": x}
            for t, b, x in ((100.0, 1.5, 1.30), (90.0, 1.4, 0.95), (120.0, 1.5, 1.10))]
    assert _median_row(rows) == {"method": "m", "identical": "2/2", "tokens_per_second": 100.0,
                                 "block_efficiency": 1.5, "speedup": 1.10}
