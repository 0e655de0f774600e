"""``specdraft train-heads --kind dflash`` through the CLI on a tiny target: the logs (held-out per-position
agreement, greedy τ estimate, decoded τ), the exported heads that draft losslessly from their folder, exact resume,
and the refusal of bad options."""

import argparse
import csv

import pytest
import torch

from specdraft.decoding import generate
from specdraft.drafters.dflash import DFlashDrafter
from specdraft.errors import SpecdraftError
from specdraft.heads import load_heads
from specdraft.models.registry import load_model
from specdraft.sequence import GenerationConfig
from specdraft.training.commands import add_training_commands
from specdraft.training.heads.dflash import parse_settings
from toys import save_tiny_checkpoint, write_data_folder


def _cli(*argv):
    parser = argparse.ArgumentParser(prog="specdraft")
    add_training_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([str(a) for a in argv])
    args.run(args)


def _setup(root):
    save_tiny_checkpoint(root / "target", seed=0, layers=4, hidden=32)
    target = load_model(str(root / "target"))
    generator = torch.Generator().manual_seed(0)
    records = []
    for number in range(24):
        prompt = torch.randint(3, 64, (int(torch.randint(2, 7, (1,), generator=generator)),), generator=generator)
        response = generate(target, prompt.tolist(), None, GenerationConfig(20)).token_ids
        records.append({"prompt_id": number, "prompt_token_ids": prompt.tolist(), "response_token_ids": response})
    write_data_folder(root / "data", records)
    return target, records


def _train(root, out, *extra):
    _cli("train-heads", "--kind", "dflash", "--target", root / "target", "--data", root / "data", "--out", out,
         "--batch-size", 4, "--lr", 1e-2, "--no-progress", "--heldout-every", 8, "--log-every", 5,
         "--options", "block_size=4;blocks=6;draft_vocab=40", *extra)


def test_train_resume_and_draft(tmp_path):
    target, records = _setup(tmp_path)
    _train(tmp_path, tmp_path / "run", "--steps", 30, "--eval-every", 15, "--eval-prompts", 2,
           "--eval-max-new-tokens", 12, "--eval-num-draft-tokens", 3)
    rows = list(csv.DictReader(open(tmp_path / "run" / "eval_log.csv")))
    assert [int(r["step"]) for r in rows] == [15, 30] and int(rows[1]["tokens"]) > int(rows[0]["tokens"]) > 0
    for key in ("heldout_loss", "heldout_top1_pos1", "heldout_top1_pos3", "greedy_tau@3", "block_efficiency@3"):
        assert key in rows[-1], rows[-1]
    assert 1 <= float(rows[-1]["greedy_tau@3"]) <= 4 and 0 <= float(rows[-1]["heldout_top1_pos1"]) <= 1
    train_rows = list(csv.DictReader(open(tmp_path / "run" / "train_log.csv")))
    assert float(train_rows[-1]["loss"]) < float(train_rows[0]["loss"])
    meta, head = load_heads(tmp_path / "run" / "heads")
    assert meta["kind"] == "dflash" and "draft_token_ids" not in meta["spec"] and meta["spec"]["block_size"] == 4
    assert head.d2t.shape == (40,) and head.d2t.dtype == torch.long and head.target_layer_ids == [0, 1, 2]
    for record in records[:3]:
        result = generate(target, record["prompt_token_ids"], DFlashDrafter(str(tmp_path / "run" / "heads")),
                          GenerationConfig(20, 3, speculation="fixed"))
        assert result.token_ids == record["response_token_ids"]
    _train(tmp_path, tmp_path / "cut", "--steps", 30, "--eval-prompts", 0, "--stop-after", 10,
           "--checkpoint-every", 10)
    _train(tmp_path, tmp_path / "cut", "--steps", 30, "--eval-prompts", 0, "--resume")
    _, resumed = load_heads(tmp_path / "cut" / "heads")
    for a, b in zip(head.state_dict().values(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_options_are_refused():
    with pytest.raises(SpecdraftError, match="unknown dflash option ttt_steps"):
        parse_settings({"ttt_steps": "3"}, 30, 100)
    with pytest.raises(SpecdraftError, match="target_layers"):
        parse_settings({"target_layers": "3,29"}, 30, 100)
    with pytest.raises(SpecdraftError, match="block_size >= 2"):
        parse_settings({"block_size": "1"}, 30, 100)
    settings = parse_settings({}, 30, 49152)
    assert settings["target_layer_ids"] == [1, 8, 14, 20, 27] and settings["block_size"] == 8
