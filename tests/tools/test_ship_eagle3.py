"""``tools/ship_eagle3.py``: heads of the wrong kind, target or shape are refused; the shipped folder is built
beside and renamed (bf16 weights, exact d2t, options, the card's generated training and results tables); an
oversized head leaves the old folder as it was."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdraft.errors import SpecdraftError
from specdraft.heads import load_heads, save_heads
from specdraft.heads.eagle import head_config
from specdraft.heads.eagle3 import build_eagle3
from specdraft.models.registry import SMOLLM2
from specdraft.training.heads.eagle3 import parse_settings
from toys import tiny_llama

TOOL = Path(__file__).resolve().parents[2] / "tools" / "ship_eagle3.py"
CARD = "# card\n\n<!-- training:begin -->\nold budget\n<!-- training:end -->\n\n<!-- results:begin -->\n" \
       "<!-- results:end -->\n"
ROW = {"method": "chain", "drafter": "eagle3", "num_draft_tokens": 3, "options": "top_k=1", "tau": 1.5,
       "first_token_acceptance": 0.4, "acceptance": 0.3, "equal_to_plain": "5/12", "speedup": 0.9,
       "questions": "question.jsonl", "per_category": 2, "prompts": 12, "dtype": "bfloat16", "max_new_tokens": 128,
       "speculation": "fixed",
       "cpu": "AMD EPYC", "cores": 2, "cpu_capability": "AVX512", "bf16_native": True, "threads": 1,
       "load_avg": [3.1, 3.4], "date": "2026-11-25"}


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("ship_eagle3", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def config():
    return tiny_llama(0, vocab_size=1000, layers=4).config


def _run(folder: Path, heads: Path | None, step: int, tokens: int, init: str = "") -> None:
    """A training run's logs beside ``folder`` (its heads)."""
    run = folder.parent
    run.mkdir(parents=True, exist_ok=True)
    (run / "train_log.csv").write_text(f"step,tokens,lr,loss,wall_s\n{step},{tokens},0.001,9.5,3600\n")
    (run / "eval_log.csv").write_text("step,tokens,heldout_top1_step0,heldout_top1_step1,greedy_tau@3,"
                                      f"block_efficiency@4\n{step},{tokens},0.35,0.3,1.5,1.9\n")
    (run / "run.json").write_text(json.dumps({"settings": {"batch_size": 4, "lr": 0.001, "init_heads": init,
                                                           "options": "loss=fkl;ttt_steps=4;draft_vocab=100"}}))


def _heads(config, out: Path, target: str = SMOLLM2, seed: int = 0, kind: str = "eagle3") -> Path:
    spec = head_config(config) | parse_settings({"draft_vocab": "100"}, 4, 1000)
    torch.manual_seed(seed)
    return save_heads(build_eagle3(spec, torch.arange(100) * 9 + 7), kind, spec, out, target)


def test_heads_of_another_target_kind_or_shape_are_refused(tool, config, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "README.md").write_text(CARD)
    with pytest.raises(SpecdraftError, match="heads for target 'tiny', not smollm2-135m-instruct"):
        tool.ship(_heads(config, tmp_path / "a", target="tiny"), tmp_path / "out", config)
    with pytest.raises(SpecdraftError, match="do not fit smollm2-135m-instruct: hidden_size 32"):
        tool.ship(_heads(config, tmp_path / "b"), tmp_path / "out", tiny_llama(0, 1000, 4, hidden=48).config)
    medusa = save_heads(torch.nn.Linear(2, 2), "medusa", {"hidden_size": 32, "vocab_size": 64}, tmp_path / "m", "t")
    with pytest.raises(SpecdraftError, match="medusa heads, not eagle3"):
        tool.ship(medusa, tmp_path / "out", config)
    with pytest.raises(SpecdraftError, match="unknown eagle3 option draft_vocab"):
        tool.check_options({"draft_vocab": "8"})
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["README.md"]


def test_ships_bf16_heads_with_the_training_chain_and_results(tool, config, tmp_path):
    first = _heads(config, tmp_path / "run1" / "heads")
    _run(first, None, 300, 185_000)
    second = _heads(config, tmp_path / "run2" / "heads", seed=1)
    _run(second, None, 1200, 700_000, init=str(first))
    out = tmp_path / "shipped"
    out.mkdir()
    (out / "README.md").write_text(CARD)
    eagle = ROW | {"method": "EAGLE", "drafter": "eagle", "options": "heads=smollm2-135m-instruct-eagle"}
    tool.ship(second, out, config, [ROW, eagle], {"top_k": 2, "tree_nodes": 4})
    tensors = load_file(str(out / "heads.safetensors"))
    assert (tensors.pop("d2t").dtype, tensors.pop("t2d").dtype) == (torch.int64, torch.bool)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    _, head = load_heads(out, kind="eagle3")
    assert torch.equal(head.draft_token_ids, torch.arange(100) * 9 + 7)
    assert json.loads((out / "drafter_options.json").read_text()) == {"top_k": 2, "tree_nodes": 4}
    card = (out / "README.md").read_text()
    assert "old budget" not in card
    assert "| 1 | a fresh head | 300 | 4 | 0.001 | fkl | 185,000 | 1.0 h |" in card
    assert "| 2 | stage 1 | 1,200 |" in card and "| all | | 1,500 | | | | 885,000 | 2.0 h |" in card
    assert "| chain | eagle3 | 3 | `top_k=1;tree_nodes=4` | 1.50 | 0.40 | 0.30 | 0.90x | 5/12 |" in card  # defaults
    assert "| EAGLE | eagle | 3 | `top_k=2;tree_nodes=4;draft_vocab=8192;heads=smollm2-135m-instruct-eagle` |" in card
    assert "2-core AMD EPYC" in card and "1 torch thread," in card and "the same depth every step" in card
    tool.ship(second, out, config)  # same weights, no results: the table stays, and so do the options
    assert "| chain | eagle3 | 3 |" in (out / "README.md").read_text()
    assert json.loads((out / "drafter_options.json").read_text()) == {"top_k": 2, "tree_nodes": 4}
    tool.ship(first, out, config)  # other weights: the old numbers go
    card = (out / "README.md").read_text()
    assert "| chain | eagle3 | 3 |" not in card and "Not measured for these weights yet" in card
    assert "| 2 | stage 1" not in card and "| 1 | a fresh head | 300 |" in card


def test_oversized_heads_leave_the_shipped_folder_unchanged(tool, config, tmp_path, monkeypatch):
    heads = _heads(config, tmp_path / "run" / "heads")
    out = tmp_path / "shipped"
    out.mkdir()
    (out / "README.md").write_text(CARD)
    tool.ship(heads, out, config)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(tool, "MAX_BYTES", 1000)
    with pytest.raises(SpecdraftError, match="the package takes"):
        tool.ship(_heads(config, tmp_path / "big" / "heads", seed=2), out, config)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big", "run", "shipped"]  # no temporary folder left


def test_results_rows_are_read_from_the_benchmark_output(tool, tmp_path):
    path = tmp_path / "tau.txt"
    path.write_text(f"writing  chain  τ 1.50\n{json.dumps(ROW)}\n")
    assert tool.read_results(path) == [ROW]
    path.write_text("writing  chain  τ 1.50\n")
    with pytest.raises(SpecdraftError, match="no result rows"):
        tool.read_results(path)
