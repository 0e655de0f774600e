"""Run folders that never lose or mix data, on a tiny random target: resume by content, atomic --overwrite,
train-drafter against changed configs, training stages that refuse to clobber a run, and shards damaged from
outside. Each case ends in a correct complete result or a one-line refusal (exit 2) with no earlier file changed."""

import hashlib
import importlib.util
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from specdraft.cli import main
from specdraft.errors import SpecdraftError
from specdraft.training.data import distill_data
from specdraft.training.data.distill_data import DistillDataConfig, generate_distillation_data
from specdraft.training.data.records import load_distill_records
from specdraft.training.runs import folders
from toys import WORDS, save_tiny_checkpoint

TOOLS = Path(__file__).resolve().parents[3] / "tools"

PIPELINE = """
target = "{root}/target"

[pretrain]
out = "{root}/pre"
source = "{root}/corpus.txt"
hidden_size = 16
num_heads = 2
num_kv_heads = 1
intermediate_size = 32
num_layers = 1
seq_len = 16
batch_size = 4
steps = {pre_steps}
heldout_every = 10
progress = false

[distill_data]
out = "{root}/data"
prompts = "{root}/prompts.jsonl"
max_new_tokens = {max_new_tokens}
temperature = 0.0
batch_size = 8
shard_size = 8
dtype = "float32"

[finetune]
out = "{root}/fine"
steps = {fine_steps}
batch_size = 4
heldout_every = 8
eval_prompts = 1
eval_max_new_tokens = 4
progress = false
"""


def _snapshot(*folders: Path) -> dict[str, str]:
    """Every file under the folders with its sha256: what a refusal must leave untouched."""
    files = sorted(p for folder in folders for p in Path(folder).rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _error_line(stderr: str) -> str:
    """The one error line (progress bars and notes may precede it)."""
    errors = [line for line in stderr.splitlines() if line.startswith("specdraft: error:")]
    assert len(errors) == 1, stderr
    return errors[0]


def _prompts(path: Path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return str(path)


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(60)}" for _ in range(rng.randint(1, 5))) for _ in range(n)]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("target") / "t", seed=0, layers=1, hidden=32))


def _data(target, prompts, out, **kwargs):
    defaults = dict(max_new_tokens=4, batch_size=4, shard_size=4, dtype="float32", temperature=0.0)
    return DistillDataConfig(target=target, out=str(out), prompts=prompts, **(defaults | kwargs))


def _distill_cli(target, prompts, out, *extra):
    return main(["distill-data", "--target", target, "--out", str(out), "--prompts", prompts, "--max-new-tokens", "4",
                 "--shard-size", "4", "--dtype", "float32", "--temperature", "0", *map(str, extra)])


# --- 1. resume by content, not by path -------------------------------------------------------------------------------


def test_edited_prompts_file_is_refused_naming_the_prompts(target, tmp_path, capsys):
    texts = _texts(10)
    prompts = _prompts(tmp_path / "p.jsonl", texts)
    assert _distill_cli(target, prompts, tmp_path / "x") == 0
    before = _snapshot(tmp_path / "x")
    _prompts(tmp_path / "p.jsonl", ["a new first line"] + texts + _texts(3, seed=1))
    capsys.readouterr()
    assert _distill_cli(target, prompts, tmp_path / "x") == 2
    error = _error_line(capsys.readouterr().err)
    assert "prompts (" in error and "content or order differs" in error
    assert _snapshot(tmp_path / "x") == before
    assert _distill_cli(target, prompts, tmp_path / "x", "--max-new-tokens", 5) == 2  # settings, named
    assert "max_new_tokens (4 -> 5)" in capsys.readouterr().err


def test_the_same_run_continues_and_a_new_folder_appears_only_for_valid_prompts(target, tmp_path):
    prompts = _prompts(tmp_path / "p.jsonl", _texts(10))
    config = _data(target, prompts, tmp_path / "x")
    generate_distillation_data(config, progress=False)
    (tmp_path / "x" / "shard-00001.jsonl").unlink()  # an interrupted run: the missing shard is made again
    assert generate_distillation_data(config, progress=False)["records"] == 10
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a b"}\n{"prompt": 3}\n')
    with pytest.raises(SpecdraftError, match=r"bad\.jsonl:2"):
        generate_distillation_data(_data(target, str(tmp_path / "bad.jsonl"), tmp_path / "never"), progress=False)
    with pytest.raises(SpecdraftError, match="no such file"):
        generate_distillation_data(_data(target, str(tmp_path / "nope.jsonl"), tmp_path / "never"), progress=False)
    assert not (tmp_path / "never").exists()


def test_json_errors_keep_their_position(tmp_path):
    from specdraft.corpus import read_jsonl

    (tmp_path / "c.jsonl").write_text('{"prompt": "a\x01b"}\n')
    with pytest.raises(SpecdraftError, match=r"c.jsonl:1: invalid JSON \(Invalid control character at line 1 "
                                             r"column 14\)"):
        read_jsonl(tmp_path / "c.jsonl")


# --- 2. an interrupted --overwrite -----------------------------------------------------------------------------------


class Killed(Exception):
    """Stands for a kill at a chosen point."""


def _kill_after(monkeypatch, module, name, calls: int):
    original, count = getattr(module, name), [0]

    def wrapper(*args, **kwargs):
        count[0] += 1
        if count[0] > calls:
            raise Killed(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)


def test_overwrite_killed_mid_run_leaves_the_old_run_whole_then_finishes(target, tmp_path, monkeypatch):
    prompts = _prompts(tmp_path / "p.jsonl", _texts(12))
    out = tmp_path / "x"
    generate_distillation_data(_data(target, prompts, out), progress=False)
    old, old_records = _snapshot(out), load_distill_records(out)
    new = _data(target, prompts, out, max_new_tokens=6)
    with monkeypatch.context() as patch:
        _kill_after(patch, distill_data.onpolicy, "generate_shard", 1)  # killed while making the second new shard
        with pytest.raises(Killed):
            generate_distillation_data(new, overwrite=True, progress=False)
    assert _snapshot(out) == old and load_distill_records(out) == old_records  # finetune still reads the old run
    assert (folders.staging_path(out) / "shard-00000.jsonl").is_file()
    manifest = generate_distillation_data(new, overwrite=True, progress=False)  # the new run resumes, then swaps
    assert manifest["complete"] and not folders.staging_path(out).exists()
    assert all(len(r["response_token_ids"]) == 6 for r in load_distill_records(out))


def test_a_kill_between_the_two_renames_of_the_swap_is_undone(target, tmp_path, monkeypatch):
    prompts = _prompts(tmp_path / "p.jsonl", _texts(8))
    out = tmp_path / "x"
    generate_distillation_data(_data(target, prompts, out), progress=False)
    old = load_distill_records(out)
    new = _data(target, prompts, out, max_new_tokens=6)
    def killed_swap(staging, out):  # out -> .old done, staging -> out not
        folders.os.replace(out, folders.old_path(out))
        raise Killed("swap_in")

    with monkeypatch.context() as patch:
        patch.setattr(folders, "swap_in", killed_swap)
        with pytest.raises(Killed):
            generate_distillation_data(new, overwrite=True, progress=False)
    assert not out.exists() and folders.old_path(out).is_dir()
    with pytest.raises(SpecdraftError, match="replacement was interrupted"):
        load_distill_records(out)
    generate_distillation_data(_data(target, prompts, out), progress=False)  # a plain rerun: the old run is back
    assert load_distill_records(out) == old
    generate_distillation_data(new, overwrite=True, progress=False)  # the staged new run is swapped in
    assert all(len(r["response_token_ids"]) == 6 for r in load_distill_records(out))
    assert not folders.old_path(out).exists() and not folders.staging_path(out).exists()


# --- 3. train-drafter and changed configs, 4. training stages into a run folder --------------------------------------


def _make_pipeline(root: Path, target: str) -> Path:
    shutil.copytree(target, root / "target")
    rng = random.Random(0)
    (root / "corpus.txt").write_text("\n\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30)))
                                                 for _ in range(60)))
    _prompts(root / "prompts.jsonl", _texts(24))
    _write_pipeline(root)
    assert main(["train-drafter", "--config", str(root / "pipeline.toml")]) == 0
    return root


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, target):
    return _make_pipeline(tmp_path_factory.mktemp("pipeline"), target)


def _write_pipeline(root: Path, pre_steps=4, max_new_tokens=4, fine_steps=3) -> None:
    (root / "pipeline.toml").write_text(PIPELINE.format(root=root, pre_steps=pre_steps, max_new_tokens=max_new_tokens,
                                                        fine_steps=fine_steps))


@pytest.mark.parametrize(("change", "named"), [({"fine_steps": 5}, "[finetune]"),
                                               ({"max_new_tokens": 5}, "[distill_data]"),
                                               ({"pre_steps": 6}, "[pretrain]")])
def test_train_drafter_refuses_a_changed_stage_and_overwrite_rebuilds_it(target, tmp_path, capsys, change, named):
    root = _make_pipeline(tmp_path, target)
    assert main(["train-drafter", "--config", str(root / "pipeline.toml")]) == 0  # unchanged: reused
    before = _snapshot(root / "pre", root / "data", root / "fine")
    _write_pipeline(root, **change)
    capsys.readouterr()
    assert main(["train-drafter", "--config", str(root / "pipeline.toml")]) == 2
    error = _error_line(capsys.readouterr().err)
    key = next(iter(change)).replace("pre_", "").replace("fine_", "")
    assert named in error and key in error, error
    assert _snapshot(root / "pre", root / "data", root / "fine") == before
    assert main(["train-drafter", "--config", str(root / "pipeline.toml"), "--overwrite"]) == 0
    card = (root / "fine" / "model" / "README.md").read_text()
    assert f"{change.get('fine_steps', 3)} steps" in card
    assert _snapshot(root / "fine") != {k: v for k, v in before.items() if "/fine/" in k}  # rebuilt: new inputs
    assert not any(p.name.startswith(".") for p in root.iterdir())  # no staging or old folder left


def _stage_cli(pipeline, stage, out, *extra):
    common = {"finetune": ["finetune", "--drafter", pipeline / "pre" / "model", "--data", pipeline / "data",
                           "--heldout-every", 8, "--eval-prompts", 0],
              "pretrain": ["pretrain", "--source", pipeline / "corpus.txt", "--hidden-size", 16, "--num-heads", 2,
                           "--num-kv-heads", 1, "--intermediate-size", 32, "--num-layers", 1, "--seq-len", 16,
                           "--heldout-every", 10]}[stage]
    return main([str(a) for a in [*common, "--target", pipeline / "target", "--out", out, "--batch-size", 4,
                                  "--no-progress", *extra]])


@pytest.mark.parametrize("stage", ["pretrain", "finetune"])
def test_a_training_stage_refuses_a_run_folder_without_resume_or_overwrite(pipeline, tmp_path, capsys, stage):
    out = tmp_path / "run"
    assert _stage_cli(pipeline, stage, out, "--steps", 4, "--stop-after", 2) == 0  # interrupted at step 2
    before = _snapshot(out)
    capsys.readouterr()
    assert _stage_cli(pipeline, stage, out, "--steps", 4) == 2
    error = capsys.readouterr().err
    assert f"holds a {stage} run (interrupted)" in error and "--resume" in error and "--overwrite" in error
    assert _stage_cli(pipeline, stage, out, "--steps", 5, "--resume") == 2
    assert "steps (4 -> 5)" in capsys.readouterr().err
    assert _snapshot(out) == before
    assert _stage_cli(pipeline, stage, out, "--steps", 4, "--resume") == 0
    assert "4 steps" in (out / "model" / "README.md").read_text()
    finished = _snapshot(out)
    assert _stage_cli(pipeline, stage, out, "--steps", 4, "--resume") == 0  # finished: reused as it is
    assert _snapshot(out) == finished


def test_finetune_on_changed_data_is_refused_on_resume(pipeline, tmp_path, capsys):
    data = shutil.copytree(pipeline / "data", tmp_path / "data")
    out = tmp_path / "run"
    args = ("--data", data, "--steps", 4, "--stop-after", 2)
    assert main([str(a) for a in ["finetune", "--drafter", pipeline / "pre" / "model", "--target",
                                  pipeline / "target", "--out", out, "--batch-size", 4, "--heldout-every", 8,
                                  "--eval-prompts", 0, "--no-progress", *args]]) == 0
    (data / "shard-00001.jsonl").unlink()
    generate_distillation_data(_data(str(pipeline / "target"), str(pipeline / "prompts.jsonl"), data,
                                     max_new_tokens=4, batch_size=8, shard_size=8), progress=False)
    record = json.loads((data / "manifest.json").read_text())  # same shards again (greedy): same data
    assert record["complete"]
    lines = (data / "shard-00000.jsonl").read_text().splitlines()
    (data / "shard-00000.jsonl").write_text("\n".join(lines[:-1] + [lines[0]]) + "\n")  # edited outside
    capsys.readouterr()
    assert main([str(a) for a in ["finetune", "--drafter", pipeline / "pre" / "model", "--target",
                                  pipeline / "target", "--out", out, "--batch-size", 4, "--heldout-every", 8,
                                  "--eval-prompts", 0, "--no-progress", "--resume", "--data", data, "--steps",
                                  4]]) == 2
    assert "shard-00000.jsonl is damaged (its checksum differs" in capsys.readouterr().err


def test_overwrite_of_a_training_run_killed_part_way_keeps_the_old_run_then_resumes(pipeline, tmp_path):
    out, fresh = tmp_path / "run", tmp_path / "fresh"
    assert _stage_cli(pipeline, "pretrain", out, "--steps", 4) == 0
    old = _snapshot(out)
    assert _stage_cli(pipeline, "pretrain", out, "--steps", 6, "--overwrite", "--stop-after", 3,
                      "--checkpoint-every", 3) == 0  # a kill after step 3 of the replacement
    assert _snapshot(out) == old and (folders.staging_path(out) / "checkpoint.pt").is_file()
    assert _stage_cli(pipeline, "pretrain", out, "--steps", 6, "--overwrite") == 0
    assert _stage_cli(pipeline, "pretrain", fresh, "--steps", 6) == 0
    assert not folders.staging_path(out).exists()
    assert ((out / "model" / "model.safetensors").read_bytes()
            == (fresh / "model" / "model.safetensors").read_bytes())  # resumed == uninterrupted


# --- 5. shards damaged from outside ----------------------------------------------------------------------------------


def test_a_truncated_shard_is_found_by_readers_and_regenerated_by_distill_data(target, tmp_path):
    prompts = _prompts(tmp_path / "p.jsonl", _texts(12))
    out = tmp_path / "x"
    config = _data(target, prompts, out)
    generate_distillation_data(config, progress=False)
    whole = (out / "shard-00001.jsonl").read_text()
    (out / "shard-00001.jsonl").write_text(whole[: len(whole) // 2])  # a copy cut short
    with pytest.raises(SpecdraftError, match=r"shard-00001.jsonl is damaged \(\d records, the manifest says 4\)"):
        load_distill_records(out)
    manifest = generate_distillation_data(config, progress=False)
    assert manifest["complete"] and manifest["records"] == 12
    assert (out / "shard-00001.jsonl").read_text() == whole
    assert (out / "shard-00001.jsonl.damaged").read_text() == whole[: len(whole) // 2]  # kept, not lost


def _older(out: Path) -> None:
    """Turn a distill-data run into the layout written before checksums and fingerprints (a flat
    distill_config.json, a manifest of record counts only)."""
    saved = json.loads((out / "distill_config.json").read_text())
    (out / "distill_config.json").write_text(json.dumps({k: v for k, v in saved.items()
                                                         if k not in ("inputs", "dtype_choice")}))
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["sha256"]
    (out / "manifest.json").write_text(json.dumps(manifest))


def test_a_data_folder_of_an_older_layout_is_refused_saying_how_to_convert_it(target, tmp_path, capsys):
    """Readers and distill-data refuse it in one line (exit 2) naming the conversion, and change nothing;
    tools/add_shard_checksums.py converts it for readers, --overwrite makes it again."""
    prompts = _prompts(tmp_path / "p.jsonl", _texts(12))
    out = tmp_path / "x"
    generate_distillation_data(_data(target, prompts, out), progress=False)
    records = load_distill_records(out)
    _older(out)
    before = _snapshot(out)
    with pytest.raises(SpecdraftError, match=r"lists its shards without their checksums \(an older specdraft's "
                                             r"layout\): add them with `python tools/add_shard_checksums.py"):
        load_distill_records(out)
    capsys.readouterr()
    assert _distill_cli(target, prompts, out) == 2
    line = _error_line(capsys.readouterr().err)
    assert "distill_config.json has no fingerprint of the prompts (an older specdraft's layout)" in line
    assert "make it again with --overwrite" in line and _snapshot(out) == before
    tool = importlib.util.spec_from_file_location("add_shard_checksums", TOOLS / "add_shard_checksums.py")
    module = importlib.util.module_from_spec(tool)
    tool.loader.exec_module(module)
    assert module.main([str(out)]) == 0 and "3 shards, 12 records, checksums added" in capsys.readouterr().out
    assert load_distill_records(out) == records  # readers take it again
    (out / "shard-00001.jsonl").write_text("")
    assert module.main([str(out)]) == 2 and "holds 0 records, the manifest says 4" in capsys.readouterr().err
    (out / "shard-00001.jsonl").unlink()
    assert _distill_cli(target, prompts, out, "--overwrite") == 0  # made again, whole
    assert load_distill_records(out) == records and "inputs" in json.loads((out / "distill_config.json").read_text())


def test_a_training_run_of_an_older_layout_is_refused_and_overwrite_replaces_it(pipeline, tmp_path, capsys):
    out = tmp_path / "run"
    assert _stage_cli(pipeline, "pretrain", out, "--steps", 2) == 0
    (out / "run.json").unlink()  # a run made before run.json existed
    before = _snapshot(out)
    capsys.readouterr()
    for extra in ((), ("--resume",)):
        assert _stage_cli(pipeline, "pretrain", out, "--steps", 2, *extra) == 2
        line = _error_line(capsys.readouterr().err)
        assert "holds a training run without run.json (an older specdraft's layout)" in line
        assert "its model/ folder loads as it is; to train it again, pass --overwrite" in line
    assert _snapshot(out) == before
    assert _stage_cli(pipeline, "pretrain", out, "--steps", 2, "--overwrite") == 0
    assert json.loads((out / "run.json").read_text())["finished"]


# --- dtype auto ------------------------------------------------------------------------------------------------------


def test_auto_dtype_is_resolved_and_logged_in_the_runs_config(target, tmp_path, monkeypatch):
    from specdraft import hardware

    monkeypatch.setattr(hardware, "cpu_bf16", lambda: (False, "test machine without bf16"))
    prompts = _prompts(tmp_path / "p.jsonl", _texts(4))
    generate_distillation_data(_data(target, prompts, tmp_path / "x", dtype="auto", device="cpu"), progress=False)
    saved = json.loads((tmp_path / "x" / "distill_config.json").read_text())
    assert saved["dtype"] == "float32" and saved["dtype_choice"]["reason"] == "auto: test machine without bf16"
    assert saved["device_choice"] == {"device": "cpu", "reason": "set explicitly"} and "device" not in saved


def test_training_stages_resolve_bf16_auto_and_record_why(pipeline, tmp_path, monkeypatch):
    from specdraft import hardware

    monkeypatch.setattr(hardware, "cpu_bf16", lambda: (False, "test machine without bf16"))
    assert _stage_cli(pipeline, "pretrain", tmp_path / "run", "--steps", 2, "--device", "cpu") == 0
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["precision"] == {"dtype": "float32", "reason": "auto: test machine without bf16"}
    assert record["settings"]["bf16"] is False and record["finished"] is True
    assert record["device"] == {"device": "cpu", "asked": "cpu"} and "device" not in record["settings"]
    assert _stage_cli(pipeline, "pretrain", tmp_path / "on", "--steps", 2, "--bf16", "--device", "cpu") == 0
    assert json.loads((tmp_path / "on" / "run.json").read_text())["precision"]["reason"] == "set explicitly"


def test_a_run_resumes_on_another_device_and_records_where(pipeline, tmp_path):
    """The device is where a run trains, not what it trains: a run stopped on one device continues under another
    --device (here auto, the CPU in tests) with no refusal, and run.json records the device of the session."""
    out = tmp_path / "run"
    assert _stage_cli(pipeline, "pretrain", out, "--steps", 4, "--stop-after", 2, "--device", "cpu", "--no-bf16") == 0
    assert json.loads((out / "run.json").read_text())["device"]["asked"] == "cpu"
    assert _stage_cli(pipeline, "pretrain", out, "--steps", 4, "--resume", "--device", "auto", "--no-bf16") == 0
    record = json.loads((out / "run.json").read_text())
    assert record["finished"] and record["device"] == {"device": "cpu", "asked": "auto"}


def test_a_device_that_is_not_there_is_refused_before_anything_is_written(pipeline, tmp_path, capsys):
    assert _stage_cli(pipeline, "pretrain", tmp_path / "run", "--steps", 2, "--device", "tpu") == 2
    assert "device must be auto, cpu, cuda or cuda:N" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert _stage_cli(pipeline, "pretrain", tmp_path / "run", "--steps", 2, "--device", "cuda:0") == 2
        assert "no CUDA device is visible" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
