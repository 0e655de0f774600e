"""``specdraft train-heads`` through the CLI on a tiny target and a tiny distill-data folder: the exported heads
folder, per-head accuracy and τ in the evaluation log, exact resume, and the bad inputs it must refuse."""

import argparse
import csv

import pytest
import torch

from specdraft.decoding import GenerationConfig, generate
from specdraft.drafters.medusa import MedusaDrafter
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


def _write_data(folder, records) -> None:
    write_data_folder(folder, records)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target folder and a distill-data folder of its greedy responses to 24 prompts."""
    root = tmp_path_factory.mktemp("heads")
    save_tiny_checkpoint(root / "target", seed=0, layers=1, hidden=32)
    target = load_model(str(root / "target"))
    generator = torch.Generator().manual_seed(0)
    records = []
    for number in range(24):
        prompt = torch.randint(3, 64, (int(torch.randint(2, 7, (1,), generator=generator)),), generator=generator)
        response = generate(target, prompt.tolist(), None, GenerationConfig(20)).token_ids
        records.append({"prompt_id": number, "prompt_token_ids": prompt.tolist(), "response_token_ids": response})
    _write_data(root / "data", records)
    return root, records


def _train(root, out, *extra):
    _cli("train-heads", "--kind", "medusa", "--target", root / "target", "--data", root / "data", "--out", out,
         "--batch-size", 4, "--lr", 1e-2, "--no-bf16", "--no-progress", "--heldout-every", 8, "--log-every", 5,
         *extra)


def test_train_heads_cli_exports_heads_and_reports_per_head_accuracy(setup, tmp_path):
    root, records = setup
    _train(root, tmp_path / "run", "--steps", 40, "--num-heads", 3, "--eval-prompts", 2, "--eval-max-new-tokens", 12,
           "--eval-num-draft-tokens", 3)
    heads = tmp_path / "run" / "heads"
    meta, _ = load_heads(heads)
    assert meta["kind"] == "medusa" and meta["spec"]["num_heads"] == 3 and meta["spec"]["share_lm_head"]
    assert "medusa heads" in (heads / "README.md").read_text()
    rows = list(csv.DictReader(open(tmp_path / "run" / "eval_log.csv")))
    for key in ("heldout_loss", "head1_top1", "head2_top1", "head3_top1", "block_efficiency@3"):
        assert key in rows[-1], rows[-1]
    assert 0 <= float(rows[-1]["head1_top1"]) <= 1 and float(rows[-1]["block_efficiency@3"]) >= 1
    train_rows = list(csv.DictReader(open(tmp_path / "run" / "train_log.csv")))
    assert float(train_rows[-1]["loss"]) < float(train_rows[0]["loss"])
    target = load_model(str(root / "target"))  # the exported heads draft losslessly
    prompt = records[0]["prompt_token_ids"]
    result = generate(target, prompt, MedusaDrafter(str(heads)), GenerationConfig(20, 3, speculation="fixed"))
    assert result.token_ids == records[0]["response_token_ids"]
    assert result.stats.block_efficiency > 1.0  # a training prompt: the heads have seen this continuation


def test_resume_continues_to_the_uninterrupted_weights(setup, tmp_path):
    root, _ = setup
    common = ("--steps", 20, "--eval-prompts", 0, "--options", "decay=0.7")
    _train(root, tmp_path / "full", *common)
    _train(root, tmp_path / "cut", *common, "--stop-after", 10, "--checkpoint-every", 10)
    assert not (tmp_path / "cut" / "heads").exists()  # no export from a stopped run
    _train(root, tmp_path / "cut", *common, "--resume", "--export-dtype", "bfloat16")
    (_, full), (meta, resumed) = load_heads(tmp_path / "full" / "heads"), load_heads(tmp_path / "cut" / "heads")
    assert meta["spec"]["decay"] == 0.7
    for a, b in zip(full.state_dict().values(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a.to(torch.bfloat16).float(), b)  # exported in bf16 (--export-dtype)


def test_init_heads_warm_starts_from_exported_heads(setup, tmp_path):
    """--init-heads: the new run starts from the old run's heads (with a ~0 learning rate it exports them
    unchanged), and a mismatched architecture is refused."""
    root, _ = setup
    _train(root, tmp_path / "first", "--steps", 20, "--eval-prompts", 0)
    _train(root, tmp_path / "again", "--steps", 1, "--lr", "1e-12", "--eval-prompts", 0, "--init-heads",
           tmp_path / "first" / "heads")
    (_, first), (_, again) = load_heads(tmp_path / "first" / "heads"), load_heads(tmp_path / "again" / "heads")
    for a, b in zip(first.state_dict().values(), again.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b)  # lr ~0: the warm start is what got exported
    _train(root, tmp_path / "soft", "--steps", 2, "--eval-prompts", 0, "--options", "distill=1", "--init-heads",
           tmp_path / "first" / "heads")  # self-distillation runs and may warm-start from hard-label heads
    assert load_heads(tmp_path / "soft" / "heads")[0]["spec"]["distill"] is True
    with pytest.raises(SpecdraftError, match="another architecture"):
        _train(root, tmp_path / "other", "--steps", 1, "--num-heads", 2, "--init-heads", tmp_path / "first" / "heads")


def test_bad_inputs_are_refused(setup, tmp_path):
    root, records = setup
    with pytest.raises(SpecdraftError, match="kind must be one of"):
        _cli("train-heads", "--kind", "nope", "--target", root / "target", "--data", root / "data", "--out", tmp_path)
    with pytest.raises(SpecdraftError, match="unknown medusa option"):
        _train(root, tmp_path / "a", "--steps", 2, "--options", "depth=3")
    with pytest.raises(SpecdraftError, match="decay must be in"):
        _train(root, tmp_path / "b", "--steps", 2, "--options", "decay=2")
    with pytest.raises(SpecdraftError, match="export_dtype must be one of"):
        _train(root, tmp_path / "b", "--steps", 2, "--export-dtype", "int8")
    with pytest.raises(SpecdraftError, match="no training checkpoint"):
        _train(root, tmp_path / "c", "--steps", 2, "--resume")
    foreign = [r | {"response_token_ids": r["response_token_ids"] + [100]} for r in records]
    _write_data(tmp_path / "foreign", foreign)
    with pytest.raises(SpecdraftError, match="outside the target's vocabulary"):
        _cli("train-heads", "--kind", "medusa", "--target", root / "target", "--data", tmp_path / "foreign",
             "--out", tmp_path / "d", "--steps", 2, "--no-progress", "--heldout-every", 8)


def test_a_heads_run_folder_is_continued_or_replaced_never_clobbered(setup, tmp_path):
    root, _ = setup
    _train(root, tmp_path / "run", "--steps", 4, "--eval-prompts", 0)
    exported = (tmp_path / "run" / "heads" / "heads.safetensors").read_bytes()
    with pytest.raises(SpecdraftError, match=r"holds a train-heads run \(finished\); pass --resume"):
        _train(root, tmp_path / "run", "--steps", 4, "--eval-prompts", 0)
    with pytest.raises(SpecdraftError, match=r"num_heads \(4 -> 2\)"):
        _train(root, tmp_path / "run", "--steps", 4, "--eval-prompts", 0, "--num-heads", 2, "--resume")
    assert (tmp_path / "run" / "heads" / "heads.safetensors").read_bytes() == exported
    _train(root, tmp_path / "run", "--steps", 4, "--eval-prompts", 0, "--num-heads", 2, "--overwrite")
    assert load_heads(tmp_path / "run" / "heads")[0]["spec"]["num_heads"] == 2
