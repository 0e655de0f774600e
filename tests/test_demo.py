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
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("method")):][:4]
    assert len({len(line) for line in table}) == 1  # columns line up, even for a long draft path
    assert table[1].startswith(f"draft:{draft} ") or table[2].startswith(f"draft:{draft} ")
    with pytest.raises(SpecdraftError, match="unknown drafter 'nope'"):
        run_demo(DemoConfig(target=target, num_prompts=1, max_new_tokens=4, drafters=("nope",)), out=lines.append)
