"""``specdraft train-heads --kind eagle3`` through the CLI on a tiny target: the learning-curve log (held-out
per-step agreement, τ estimate and decoded τ against training tokens), the exported heads that draft losslessly,
exact resume, and the export of the result."""

import argparse
import csv
import json

import pytest
import torch

from specdraft.cli import main
from specdraft.decoding import GenerationConfig, generate
from specdraft.drafters.eagle3 import Eagle3Drafter
from specdraft.errors import SpecdraftError
from specdraft.heads import load_heads
from specdraft.models.registry import load_model
from specdraft.training.commands import add_training_commands
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
    _cli("train-heads", "--kind", "eagle3", "--target", root / "target", "--data", root / "data", "--out", out,
         "--batch-size", 4, "--lr", 1e-2, "--no-progress", "--heldout-every", 8, "--log-every", 5,
         "--options", "ttt_steps=3;draft_vocab=40", *extra)


def test_train_resume_and_export(tmp_path):
    target, records = _setup(tmp_path)
    _train(tmp_path, tmp_path / "run", "--steps", 30, "--eval-every", 15, "--eval-prompts", 2,
           "--eval-max-new-tokens", 12, "--eval-num-draft-tokens", 3)
    rows = list(csv.DictReader(open(tmp_path / "run" / "eval_log.csv")))
    assert [int(r["step"]) for r in rows] == [15, 30] and int(rows[1]["tokens"]) > int(rows[0]["tokens"]) > 0
    for key in ("heldout_top1_step0", "heldout_top1_step2", "greedy_tau@3", "block_efficiency@3"):
        assert key in rows[-1], rows[-1]
    assert 1 <= float(rows[-1]["greedy_tau@3"]) <= 4 and 0 <= float(rows[-1]["heldout_top1_step0"]) <= 1
    train_rows = list(csv.DictReader(open(tmp_path / "run" / "train_log.csv")))
    assert float(train_rows[-1]["loss"]) < float(train_rows[0]["loss"])
    meta, head = load_heads(tmp_path / "run" / "heads")
    assert meta["kind"] == "eagle3" and "draft_token_ids" not in meta["spec"] and meta["spec"]["ttt_steps"] == 3
    assert int(head.t2d.sum()) == 40 and head.aux_layers == [0, 2, 3]
    prompt = records[0]["prompt_token_ids"]
    result = generate(target, prompt, Eagle3Drafter(str(tmp_path / "run" / "heads")), GenerationConfig(20, 3))
    assert result.token_ids == records[0]["response_token_ids"]
    _train(tmp_path, tmp_path / "cut", "--steps", 30, "--eval-prompts", 0, "--stop-after", 10,
           "--checkpoint-every", 10)
    _train(tmp_path, tmp_path / "cut", "--steps", 30, "--eval-prompts", 0, "--resume")
    _, resumed = load_heads(tmp_path / "cut" / "heads")
    for a, b in zip(head.state_dict().values(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b)
    assert main(["export", str(tmp_path / "run" / "heads"), "--format", "eagle3", "--out", str(tmp_path / "flat"),
                 "--target", str(tmp_path / "target")]) == 0
    assert json.loads((tmp_path / "flat" / "config.json").read_text())["draft_vocab_size"] == 40


def test_a_registered_loss_with_its_setting_trains_the_heads(tmp_path):
    """``--options 'loss=skl;alpha=0.2'``: DistiLLM's skew KL from the loss registry trains EAGLE-3 heads (the
    loss falls), and the heads record the loss and its setting; a setting of another loss is refused."""
    _setup(tmp_path)
    _train(tmp_path, tmp_path / "skl", "--steps", 20, "--eval-prompts", 0, "--options",
           "ttt_steps=3;draft_vocab=40;loss=skl;alpha=0.2")
    rows = list(csv.DictReader(open(tmp_path / "skl" / "train_log.csv")))
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"])
    meta, _ = load_heads(tmp_path / "skl" / "heads")
    assert meta["spec"]["loss"] == "skl" and meta["spec"]["loss_options"] == {"alpha": 0.2}
    with pytest.raises(SpecdraftError, match="unknown eagle3 option alpha"):
        _train(tmp_path, tmp_path / "bad", "--steps", 2, "--options", "loss=fkl;alpha=0.2")
