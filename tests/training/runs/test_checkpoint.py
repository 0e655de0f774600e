"""Training checkpoints are atomic and checked on load; the HF export is complete or absent, and the exported
drafter works with transformers' assisted generation and with specdraft's own loader."""

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from specdraft.api import load_drafter, load_target
from specdraft.decoding import GenerationConfig, generate
from specdraft.errors import SpecdraftError
from specdraft.training.drafter.init_drafter import DrafterConfig
from specdraft.training.runs import checkpoint
from specdraft.training.runs.checkpoint import (
    EXPORT_FILES,
    export_hf,
    is_complete_export,
    load_training_state,
    save_training_state,
)
from toys import save_tiny_checkpoint


def _state(step=3):
    return {"model": {"w": torch.arange(4.0)}, "optimizer": {}, "scheduler": {}, "step": step,
            "rng": {"torch": torch.get_rng_state()}, "data": {"epoch": 0, "offset": 8}}


def test_save_load_round_trip_leaves_no_temp_file(tmp_path):
    path = save_training_state(tmp_path / "checkpoint.pt", _state())
    state = load_training_state(path)
    assert state["step"] == 3 and torch.equal(state["model"]["w"], torch.arange(4.0))
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_a_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = save_training_state(tmp_path / "checkpoint.pt", _state(step=1))

    def broken_save(obj, file):
        file.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_training_state(path, _state(step=2))
    assert load_training_state(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_missing_corrupt_or_foreign_checkpoints_are_clear_errors(tmp_path):
    with pytest.raises(SpecdraftError, match="no training checkpoint"):
        load_training_state(tmp_path / "nope.pt")
    good = save_training_state(tmp_path / "good.pt", _state())
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:100])
    with pytest.raises(SpecdraftError, match="corrupt"):
        load_training_state(truncated)
    (tmp_path / "garbage.pt").write_bytes(b"\x00not a checkpoint")
    with pytest.raises(SpecdraftError, match="corrupt"):
        load_training_state(tmp_path / "garbage.pt")
    torch.save({"model": {}}, tmp_path / "foreign.pt")
    with pytest.raises(SpecdraftError, match="not a specdraft training checkpoint"):
        load_training_state(tmp_path / "foreign.pt")
    with pytest.raises(SpecdraftError, match="lacks"):
        save_training_state(tmp_path / "x.pt", {"model": {}})


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("target") / "t", seed=0))


def _drafter(target_dir, seed=1):
    torch.manual_seed(seed)
    config = DrafterConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64)
    target_config = AutoModelForCausalLM.from_pretrained(target_dir).config
    return LlamaForCausalLM(config.llama_config(target_config)).eval()


CARD = {"title": "test drafter", "command": "specdraft pretrain --steps 3", "data": "synthetic",
        "budget": {"Budget": "3 steps"}, "metrics": {"heldout_loss": 1.25}}


def test_export_is_complete_and_generates_like_the_target(target_dir, tmp_path):
    out = export_hf(_drafter(target_dir), tmp_path / "drafter", target_dir, CARD)
    assert is_complete_export(out)
    assert {p.name for p in out.iterdir()} >= {*EXPORT_FILES, "tokenizer.json"}
    card = (out / "README.md").read_text()
    assert "specdraft pretrain --steps 3" in card and "heldout_loss" in card and "1.25" in card
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["drafter"]  # no temp folder left

    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    assistant = AutoModelForCausalLM.from_pretrained(out).eval()
    assistant.generation_config.num_assistant_tokens = 4
    prompt = torch.tensor([[1, 5, 9, 14, 3]])
    kwargs = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    plain = target.generate(prompt, **kwargs)
    assisted = target.generate(prompt, assistant_model=assistant, **kwargs)
    assert torch.equal(plain, assisted) and plain.shape[1] > prompt.shape[1]


def test_export_loads_with_specdraft_load_drafter(target_dir, tmp_path):
    out = export_hf(_drafter(target_dir), tmp_path / "drafter", target_dir, CARD)
    target, tokenizer = load_target(target_dir)
    drafter = load_drafter(target, tokenizer, draft=str(out))
    config = GenerationConfig(max_new_tokens=16, num_draft_tokens=3)
    assert generate(target, [1, 5, 9], drafter, config).token_ids == generate(target, [1, 5, 9], None, config).token_ids


def test_bf16_export_and_replacing_an_old_export(target_dir, tmp_path):
    out = export_hf(_drafter(target_dir, seed=1), tmp_path / "drafter", target_dir, CARD)
    model = _drafter(target_dir, seed=2)
    export_hf(model, out, target_dir, CARD, dtype=torch.bfloat16)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))
    assert model.lm_head.weight.dtype == torch.float32  # the trained model is left as it was
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]


def test_a_failed_export_leaves_nothing_that_looks_complete(target_dir, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "model_card", broken)
    with pytest.raises(OSError, match="disk full"):
        export_hf(_drafter(target_dir), tmp_path / "drafter", target_dir, CARD)
    assert os.listdir(tmp_path) == []
    assert not is_complete_export(tmp_path / "drafter")



def test_the_cards_hardware_line_names_the_device_the_run_used():
    from specdraft.hardware import cpu_model
    from specdraft.training.runs.checkpoint import hardware

    assert hardware("cpu").startswith(f"CPU ({cpu_model()}), ")  # whether or not a GPU is visible
    assert hardware().startswith("CPU (")  # auto is the CPU in tests
