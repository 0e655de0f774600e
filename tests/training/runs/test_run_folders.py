"""A careless user's mistakes end in one line and leave nothing behind, on a tiny random target: unreadable or
non-UTF-8 input and folders that become unwritable mid-run end in one ``specdraft: error:`` line naming the file
(exit 2, no traceback); a run owns its folder (a second writer is refused, a stale lock after a kill -9 is taken
over); a resumed run logs each step once and leaves no temp file of the killed one."""

import csv
import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specdraft import cli
from specdraft.cli import main
from specdraft.errors import SpecdraftError
from specdraft.files import lock_path, owning, remove_leftovers
from specdraft.training.data import distill_data as generation
from specdraft.training.data.distill_data import DistillDataConfig, generate_distillation_data
from specdraft.training.runs import folders as runs
from specdraft.training.runs import trainer
from toys import save_tiny_checkpoint


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A target, a smaller drafter of its vocabulary, and a finished distill-data folder of 32 prompts."""
    root = tmp_path_factory.mktemp("models")
    target = str(save_tiny_checkpoint(root / "target", seed=0, layers=1, hidden=32))
    drafter = str(save_tiny_checkpoint(root / "drafter", seed=1, layers=1, hidden=16))
    prompts = _prompts(root / "p.jsonl", 32)
    generate_distillation_data(DistillDataConfig(target=target, out=str(root / "data"), prompts=prompts,
                                                 max_new_tokens=6, shard_size=8, dtype="float32", temperature=0.0),
                               progress=False)
    return {"target": target, "drafter": drafter, "prompts": prompts, "data": str(root / "data")}


def _prompts(path: Path, n: int) -> str:
    rng = random.Random(0)
    path.write_text("".join(json.dumps({"prompt": " ".join(f"w{rng.randrange(60)}" for _ in range(3))}) + "\n"
                            for _ in range(n)))
    return str(path)


def _one_error(capsys) -> str:
    """The one error line of a failed command; stderr holds no traceback."""
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("specdraft: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def _distill(models, out, prompts=None, *extra) -> int:
    return main(["distill-data", "--target", models["target"], "--out", str(out), "--prompts",
                 prompts or models["prompts"], "--max-new-tokens", "4", "--shard-size", "8", "--dtype", "float32",
                 "--temperature", "0", *extra])


def _finetune_args(models, out, *extra, steps: int = 6) -> list[str]:
    return [str(a) for a in ["finetune", "--drafter", models["drafter"], "--target", models["target"], "--data",
                             models["data"], "--out", out, "--batch-size", 4, "--heldout-every", 8, "--eval-prompts",
                             0, "--no-progress", "--log-every", 1, "--checkpoint-every", 2, "--eval-every", 2,
                             "--steps", steps, "--device", "cpu", *extra]]  # a process the test starts: the CPU by name


def _steps(path: Path) -> list[int]:
    with open(path, newline="") as file:
        return [int(row["step"]) for row in csv.DictReader(file)]


def _temp_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*.tmp"))


class Freezer:
    """Makes files and folders unwritable for real: ``chattr +i`` as root (who ignores modes), ``chmod`` otherwise;
    a test skips where that does not stop a write. Everything frozen is thawed at the end."""

    def __init__(self, probe: Path) -> None:
        self.frozen: list[Path] = []
        self.root = os.geteuid() == 0
        probe.mkdir()
        try:
            self.freeze(probe)
            works = not _can_create(probe / "x")
        except (OSError, subprocess.CalledProcessError):
            works = False
        finally:
            self.thaw()
        if not works:
            pytest.skip("cannot make a folder unwritable here (no chattr +i as root, or modes ignored)")

    def freeze(self, path: Path) -> None:
        self.frozen.append(path)
        if self.root:
            subprocess.run(["chattr", "+i", str(path)], check=True, capture_output=True)
        else:
            path.chmod(0o555 if path.is_dir() else 0o444)

    def thaw(self) -> None:
        for path in reversed(self.frozen):
            if self.root:
                subprocess.run(["chattr", "-i", str(path)], check=False, capture_output=True)
            else:
                path.chmod(0o755 if path.is_dir() else 0o644)
        self.frozen.clear()


def _can_create(path: Path) -> bool:
    try:
        path.touch()
    except OSError:
        return False
    return True


@pytest.fixture
def freezer(tmp_path):
    freezer = Freezer(tmp_path / "probe")
    yield freezer
    freezer.thaw()


# --- unreadable input ----------------------------------------------------------------------------------------------


def test_prompts_that_are_not_utf8_end_in_one_line_naming_file_and_line(models, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9\xff"}\n')
    assert _distill(models, tmp_path / "out", str(bad)) == 2
    error = _one_error(capsys)
    assert f"{bad}:2: not UTF-8 text (byte 0xe9 at column 16)" in error, error
    assert not (tmp_path / "out").exists()


def test_prompts_naming_a_folder_end_in_one_line(models, tmp_path, capsys):
    (tmp_path / "folder").mkdir()
    assert _distill(models, tmp_path / "out", str(tmp_path / "folder")) == 2
    assert f"{tmp_path / 'folder'} is a folder, not a file" in _one_error(capsys)
    assert not (tmp_path / "out").exists()


def test_pretraining_text_that_is_not_utf8_is_named(tmp_path):
    from specdraft.corpus import text_source

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("one document\n\nanother")
    (tmp_path / "corpus" / "b.txt").write_bytes(b"caf\xe9 au lait")
    with pytest.raises(SpecdraftError, match=r"b\.txt: not UTF-8 text \(byte 0xe9 at byte 4\)"):
        list(text_source(str(tmp_path / "corpus")))


def test_any_os_error_of_a_command_is_one_line_naming_the_file(monkeypatch, capsys):
    def unwritable(args):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/runs/x/file.json")

    monkeypatch.setattr(cli, "_run_calibrate", unwritable)
    assert main(["calibrate"]) == 2
    assert _one_error(capsys) == "specdraft: error: /runs/x/file.json: Permission denied"


def test_a_failed_atomic_write_names_the_file_meant_and_leaves_no_temp_file(tmp_path, monkeypatch):
    from specdraft import files

    def full(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), src)

    monkeypatch.setattr(files.os, "replace", full)
    with pytest.raises(OSError) as caught:
        files.write_text_atomic(tmp_path / "manifest.json", "{}")
    assert caught.value.filename == str(tmp_path / "manifest.json") and caught.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


# --- output that becomes unwritable mid-run ------------------------------------------------------------------------


def test_distill_data_into_a_folder_made_unwritable_mid_run(models, tmp_path, capsys, monkeypatch, freezer):
    out = tmp_path / "out"
    make = generation.onpolicy.generate_shard
    calls = []

    def frozen_after_the_first_shard(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            freezer.freeze(out)
        return make(*args, **kwargs)

    monkeypatch.setattr(generation.onpolicy, "generate_shard", frozen_after_the_first_shard)
    assert _distill(models, out) == 2
    error = _one_error(capsys)
    assert f"{out / 'shard-00001.jsonl'}: " in error and ("not permitted" in error or "denied" in error), error
    freezer.thaw()
    assert sorted(p.name for p in out.iterdir()) == ["distill_config.json", "manifest.json", "shard-00000.jsonl"]
    assert _distill(models, out) == 0  # the same command finishes the run
    assert json.loads((out / "manifest.json").read_text())["complete"]
    assert not _temp_files(out)


def test_finetune_whose_train_log_becomes_unwritable_then_resumes_logging_each_step_once(models, tmp_path, capsys,
                                                                                           monkeypatch, freezer):
    out = tmp_path / "run"
    write = trainer.RunLog.write

    def frozen_at_step_3(self, name, row):
        if name == "train" and row["step"] == 3:
            freezer.freeze(self.out / "train_log.csv")
        write(self, name, row)

    with monkeypatch.context() as patch:
        patch.setattr(trainer.RunLog, "write", frozen_at_step_3)
        assert main(_finetune_args(models, out)) == 2
    error = _one_error(capsys)
    assert f"{out / 'train_log.csv'}: " in error, error
    freezer.thaw()
    assert main(_finetune_args(models, out, "--resume")) == 0
    assert _steps(out / "train_log.csv") == [1, 2, 3, 4, 5, 6]
    assert _steps(out / "eval_log.csv") == [2, 4, 6]


# --- a run owns its folder; a kill -9 leaves nothing the resumed run keeps ----------------------------------------

KILLED_MID_CHECKPOINT = """
import sys, time
from pathlib import Path
import torch
save, calls = torch.save, []
def paused_save(obj, file):  # the second checkpoint write stops half-way, until the test kills this process
    calls.append(1)
    if len(calls) == 2:
        file.write(b"part of a checkpoint")
        file.flush()
        Path(sys.argv[1]).touch()
        time.sleep(120)
    save(obj, file)
torch.save = paused_save
from specdraft.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_a_second_writer_is_refused_and_a_run_killed_mid_checkpoint_resumes_clean(models, tmp_path, capsys):
    out, ready = tmp_path / "run", tmp_path / "ready"
    args = _finetune_args(models, out)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_MID_CHECKPOINT, str(ready), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=os.environ | {"SPECDRAFT_ROWGEMM": "0", **TWO_THREADS})  # never killed in a build
    try:
        deadline = time.time() + 120
        while not ready.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the run never reached its second checkpoint"
        for extra in ((), ("--resume",), ("--overwrite",)):  # a second writer, however it asks, is refused
            assert main(args + list(extra)) == 2
            error = _one_error(capsys)
            assert f"{out} is being written by another run (pid {proc.pid} on " in error, error
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert len(list(out.glob(".checkpoint.pt.*.tmp"))) == 1  # the killed write
    assert lock_path(out).is_file()  # stale: nobody holds it
    assert _steps(out / "train_log.csv") == [1, 2, 3, 4]  # the checkpoint holds step 2
    assert main(args + ["--resume"]) == 0
    err = capsys.readouterr().err
    assert "ended without releasing its lock (killed?); taken over" in err and "removed 1 temp file(s)" in err, err
    assert _steps(out / "train_log.csv") == [1, 2, 3, 4, 5, 6]
    assert _steps(out / "eval_log.csv") == [2, 4, 6]
    assert not _temp_files(out) and not lock_path(out).exists()
    assert _recorded_threads(out) == 2  # this process runs 1 thread (conftest): the resume took the run's 2 back
    assert main(_finetune_args(models, tmp_path / "fresh", "--threads", 2)) == 0  # resumed == uninterrupted
    assert ((out / "model" / "model.safetensors").read_bytes()
            == (tmp_path / "fresh" / "model" / "model.safetensors").read_bytes())


# A child process with torch's default of 2 intra-op threads where this one (conftest) has 1.
TWO_THREADS = {"OMP_NUM_THREADS": "2"}
RUN_CLI = "import sys\nfrom specdraft.cli import main\nsys.exit(main(sys.argv[1:]))"


def _recorded_threads(out: Path) -> int:
    return json.loads((out / "run.json").read_text())["arithmetic"]["threads"]


def test_a_run_resumed_at_every_checkpoint_in_other_processes_ends_with_the_uninterrupted_weights(models, tmp_path):
    """Stopped after every step and resumed, alternately by a child process of 2 threads and by this one of 1, a run
    ends byte-equal to an uninterrupted one of 2 threads: each resume takes the run's recorded thread count back."""
    out, steps = tmp_path / "run", 4
    args = _finetune_args(models, out, "--checkpoint-every", 1, steps=steps)
    for step in range(1, steps + 1):
        stop = ["--stop-after", str(step)] if step < steps else []
        again = ["--resume"] if step > 1 else []
        if step % 2:  # odd: a fresh interpreter; even: this process
            child = subprocess.run([sys.executable, "-c", RUN_CLI, *args, *again, *stop], capture_output=True,
                                   text=True, timeout=600, env=os.environ | TWO_THREADS)  # a hang guard
            assert child.returncode == 0, child.stderr[-2000:]
        else:
            assert main(args + again + stop) == 0
        assert _recorded_threads(out) == 2 and _steps(out / "train_log.csv") == list(range(1, step + 1))
    assert torch.get_num_threads() == 1  # this process's own count is back
    reference = tmp_path / "reference"
    assert main(_finetune_args(models, reference, "--checkpoint-every", 1, "--threads", 2, steps=steps)) == 0
    assert ((out / "model" / "model.safetensors").read_bytes()
            == (reference / "model" / "model.safetensors").read_bytes())


def test_a_resume_with_other_arithmetic_says_its_weights_will_differ(models, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_finetune_args(models, out, "--stop-after", 2)) == 0
    record = json.loads((out / "run.json").read_text())
    assert record["arithmetic"]["threads"] == torch.get_num_threads() == 1
    assert main(_finetune_args(models, out, "--resume", "--threads", 2)) == 0
    err = capsys.readouterr().err
    assert "resumed with other arithmetic than its checkpoint was made with (threads 1 -> 2)" in err, err
    assert _recorded_threads(out) == 2


def test_the_lock_is_shared_by_nested_owners_and_deleted_on_release(tmp_path):
    folder = tmp_path / "run"
    with owning(folder):
        assert lock_path(folder).is_file() and str(os.getpid()) in lock_path(folder).read_text()
        with owning(folder):  # train-drafter's stage, then the stage itself: one process, one lock
            pass
        assert lock_path(folder).is_file()
        code = f"from specdraft.files import owning\nwith owning({str(folder)!r}): pass"
        other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert other.returncode != 0 and "is being written by another run" in other.stderr
    assert not lock_path(folder).exists()
    with pytest.raises(SpecdraftError, match="is being written"), owning(folder):
        raise SpecdraftError("is being written: the block's own error passes through")
    assert not lock_path(folder).exists()  # released on an error too


def test_leftovers_of_killed_writes_are_removed_and_nothing_else(tmp_path):
    keep = ["checkpoint.pt", "train_log.csv", "shard-00000.jsonl.damaged", ".hidden", "model/model.safetensors",
            "other-run/.checkpoint.pt.x1.tmp"]  # a subfolder may be another run, with its own lock
    gone = [".checkpoint.pt.k2j3.tmp", ".run.json.77.tmp", ".model.x8d.tmp/config.json", ".model.old-123/config.json"]
    for name in keep + gone:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    assert remove_leftovers(tmp_path) == sorted(Path(name).parts[0] for name in gone)
    assert all((tmp_path / name).is_file() for name in keep)
    assert not any((tmp_path / Path(name).parts[0]).exists() for name in gone)


def test_a_resumed_log_keeps_rows_up_to_its_step_and_drops_a_torn_row(tmp_path):
    log = tmp_path / "train_log.csv"
    log.write_text("step,loss\r\n1,0.5\r\n2,0.4\r\n3,0.3\r\n4,0.2\r\n1")
    runs.rewind_log(log, 2)
    assert log.read_bytes() == b"step,loss\r\n1,0.5\r\n2,0.4\r\n"
    runs.rewind_log(log, 0)
    assert not log.exists()
