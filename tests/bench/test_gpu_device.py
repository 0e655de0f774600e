"""benchmarks/gpu_device.py and gpu_recipe.py: the GPU recipe's run on a device machine, on the CPU at toy sizes. The
bundle is cut into parts that each fit a call beside the working tree, staged in any order and joined; results are
packed within a call's file limits; and the whole run (tests in the background while parts travel, then the
recipe's data, both drafter lines and exact τ) survives a kill mid-way: run again, it skips the phases that
finished, ends the phase left running and continues."""

import contextlib
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from toys import save_tiny_checkpoint

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("gpu_device", BENCHMARKS / "gpu_device.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _inputs(root: Path) -> tuple[Path, Path, Path]:
    rng = random.Random(0)
    target = root / "target.gguf"
    target.write_bytes(rng.randbytes(300_000))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w{rng.randrange(60)} w{rng.randrange(60)}"}) + "\n"
                               for _ in range(40)))
    questions = root / "question.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "turns": [f"w{i} w3"]}) + "\n" for i in range(8)))
    return target, prompts, questions


def _only(carried: Path, call: int, root: Path) -> Path:
    """What one call carries: its own folder alone."""
    folder = root / f"carry-{call}"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(carried / f"call-{call}", folder / f"call-{call}")
    return folder


def test_the_bundle_fits_each_call_and_is_staged_in_any_order_then_joined(script, tmp_path):
    target, prompts, questions = _inputs(tmp_path)
    carried, work, room = tmp_path / ".gpu", tmp_path / "work", 200_000
    manifest = script.bundle(target, prompts, questions, carried, room)
    calls = manifest["calls"]
    assert calls == len(list(carried.glob("call-*"))) >= 3
    for folder in carried.glob("call-*"):  # each call's folder fits the room left beside the working tree
        assert sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) <= room
    with pytest.raises(SystemExit, match="has not seen call 1"):
        script.stage(_only(carried, 2, tmp_path), work)
    staged = [script.stage(_only(carried, call, tmp_path), work)[1] for call in [1, calls, *range(2, calls)]]
    assert staged[0] == list(range(2, calls + 1)) and staged[1] == list(range(2, calls)) and staged[-1] == []
    bundle = script.unbundle(manifest, work)
    for source, name in ((target, "target.gguf"), (prompts, "prompts.jsonl"), (questions, "question.jsonl")):
        assert (bundle / name).read_bytes() == source.read_bytes()
    assert not (work / "parts").exists() and script.unbundle(manifest, work) == bundle  # once
    assert script.stage(_only(carried, 2, tmp_path), work)[1] == []  # a call after the join: nothing missing
    script.stage(_only(carried, 1, tmp_path), tmp_path / "other")
    damaged = _only(carried, 2, tmp_path / "again")
    part = damaged / "call-2" / "part-2"
    part.write_bytes(b"x" + part.read_bytes()[1:])
    with pytest.raises(SystemExit, match="damaged"):
        script.stage(damaged, tmp_path / "other")


def test_a_compressed_bundle_carries_the_prompts_as_text(script, tmp_path):
    import gzip

    target, prompts, questions = _inputs(tmp_path)
    packed = tmp_path / "prompts.jsonl.gz"
    packed.write_bytes(gzip.compress(prompts.read_bytes()))
    manifest = script.bundle(target, packed, questions, tmp_path / ".gpu", 400_000, xz=True)
    assert manifest["archive"]["name"] == "bundle.tar.xz"
    for call in range(1, manifest["calls"] + 1):
        script.stage(_only(tmp_path / ".gpu", call, tmp_path), tmp_path / "work")
    bundle = script.unbundle(manifest, tmp_path / "work")
    assert (bundle / "prompts.jsonl").read_bytes() == prompts.read_bytes()
    assert (bundle / "target.gguf").read_bytes() == target.read_bytes()


def test_the_travelling_tree_is_the_tracked_and_the_untracked_files_git_does_not_ignore(script, tmp_path):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / ".gitignore").write_text("/.gpu/\n")
    (tmp_path / "tracked.bin").write_bytes(b"t" * 1000)
    git("add", ".")
    (tmp_path / "new.bin").write_bytes(b"n" * 300)
    (tmp_path / ".gpu").mkdir()
    (tmp_path / ".gpu" / "part").write_bytes(b"p" * 5000)
    assert script.travelling_bytes(tmp_path) == 1000 + 300 + len("/.gpu/\n")


def test_results_are_packed_within_a_calls_file_limits_and_unpacked(script, tmp_path, monkeypatch):
    results = tmp_path / "results"
    (results / "logs").mkdir(parents=True)
    (results / "logs" / "tests.log").write_text("PASSED tests/x.py::test_a\n")
    (results / "summary.json").write_text(json.dumps({"phases": {"tests": {"status": "ok"}}}))
    (results / "exports" / "drafter").mkdir(parents=True)
    weights = random.Random(1).randbytes(5_000)
    (results / "exports" / "drafter" / "model.safetensors").write_bytes(weights)
    monkeypatch.setattr(script, "PIECE", 8_000)  # small limits: 3 pieces of exports (a tar of 20 KiB)
    monkeypatch.setattr(script, "OUT_TOTAL", script.MIB + 6_000)
    out = tmp_path / "out"
    written = script.pack_results(results, out)
    names = sorted(p.name for p in out.iterdir())
    assert sorted(written) == names and len(names) <= script.OUT_FILES
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", n) for n in names)
    packed = json.loads((out / "summary.json").read_text())["packed"]
    assert packed["left_out"] and set(packed["files"]) == set(names)  # what did not fit is named
    monkeypatch.setattr(script, "OUT_TOTAL", 64 * script.MIB)
    script.pack_results(results, out)
    assert not json.loads((out / "summary.json").read_text())["packed"]["left_out"]
    script.unpack(out, tmp_path / "back")
    assert (tmp_path / "back" / "exports" / "drafter" / "model.safetensors").read_bytes() == weights
    assert (tmp_path / "back" / "tests.txt").read_text().startswith("PASSED")


def _device(carried: Path, work: Path, out: Path, toy: Path, *extra: str) -> list[str]:
    return [sys.executable, str(BENCHMARKS / "gpu_device.py"), "device", "--carried", str(carried), "--work",
            str(work), "--pack", str(out), "--tiny", "--device", "cpu", "--shipped", str(toy / "shipped"),
            "--tests", "tests/test_stopping.py", "--phases", "data,drafter,tau", "--budget", "3000", *extra]


def _phases(work: Path) -> dict:
    try:
        return json.loads((work / "out" / "summary.json").read_text())["phases"]
    except (OSError, ValueError, KeyError):
        return {}


def test_a_device_run_survives_a_kill_and_continues_where_it_was(script, tmp_path):
    from specdraft.cli import main

    toy = tmp_path / "toy"
    save_tiny_checkpoint(toy / "target", seed=0, layers=4, hidden=32)
    _, prompts, questions = _inputs(toy)
    assert main(["init-drafter", "--target", str(toy / "target"), "--layers", "0", "--out", str(toy / "shipped")]) == 0
    carried, work = tmp_path / ".gpu", tmp_path / "work"
    script.bundle(toy / "target", prompts, questions, carried, 180_000)
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    first = subprocess.run(_device(_only(carried, 1, tmp_path), work, tmp_path / "out-1", toy), env=env,
                           capture_output=True, text=True, timeout=120)
    assert first.returncode == 0 and json.loads((tmp_path / "out-1" / "staged.json").read_text())["missing"] == [2]
    last = _only(carried, 2, tmp_path)
    killed = subprocess.Popen(_device(last, work, tmp_path / "out-2", toy, "--tests-wait", "120"), env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline, left = time.monotonic() + 600, None
    while left is None and time.monotonic() < deadline:  # until the phase after drafter-shipped has started
        assert killed.poll() is None, "the run ended before it could be killed"
        if _phases(work).get("drafter-shipped", {}).get("status") == "ok":
            with contextlib.suppress(OSError, ValueError):  # between two phases there is no pid file
                left = int((work / "run" / "phase.pid").read_text())
        time.sleep(0.2)
    assert left is not None, "drafter-copy did not start in 600 s"
    os.killpg(killed.pid, signal.SIGKILL)  # gpu_device and the recipe; the phase running (its own group) is left
    killed.wait()
    rerun = subprocess.run(_device(last, work, tmp_path / "out-3", toy), env=env, capture_output=True, text=True,
                           timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert not Path(f"/proc/{left}").exists() or "Z" in Path(f"/proc/{left}/stat").read_text().split()[2]
    phases = _phases(work)
    assert {name: record["status"] for name, record in phases.items()} == dict.fromkeys(
        ["tests", "target", "data", "drafter-shipped", "drafter-copy", "tau"], "ok")
    assert [phases[p]["call"] for p in ("tests", "data", "drafter-shipped", "drafter-copy", "tau")] == [1, 2, 2, 3, 3]
    log = (work / "out" / "logs" / "drafter-copy.log").read_text()
    assert log.count("# call ") == 2 and "finished earlier: data, drafter-shipped" in rerun.stdout
    names = sorted(p.name for p in (tmp_path / "out-3").iterdir())
    assert len(names) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", n) for n in names)
    assert all((tmp_path / "out-3" / n).stat().st_size <= 16 << 20 for n in names)
    script.unpack(tmp_path / "out-3", tmp_path / "back")
    summary = json.loads((tmp_path / "back" / "summary.json").read_text())
    assert (tmp_path / "back" / "exports" / "drafter" / "config.json").is_file()
    assert "PASSED tests/test_stopping.py" in (tmp_path / "back" / "tests.txt").read_text()
    lines = summary["verdicts"]["greedy_tau_by_line"]
    assert set(lines) == {"shipped", "copy"} and all(1.0 <= t["greedy_tau@4"] <= 5.0 for t in lines.values())
    assert summary["verdicts"]["greedy_tau_shipped"]["greedy_tau@4"] >= 1.0
    assert [int(row["step"]) for row in summary["curves"]["shipped-fkl"]] == [2, 4]  # the learning curve


def test_answers_made_elsewhere_travel_instead_of_prompts_and_are_trained_on_as_they_are(script, tmp_path):
    import gzip

    from specdraft.cli import main

    toy = tmp_path / "toy"
    save_tiny_checkpoint(toy / "target", seed=0, layers=4, hidden=32)
    _, _, questions = _inputs(toy)
    rng = random.Random(2)
    answers = [{"prompt": f"w{i} w{rng.randrange(60)}", "answer_ids": [rng.randrange(3, 61) for _ in range(6)]}
               for i in range(30)]
    packed = toy / "answers.jsonl.gz"
    packed.write_bytes(gzip.compress("".join(json.dumps(a) + "\n" for a in answers).encode()))
    assert main(["init-drafter", "--target", str(toy / "target"), "--layers", "0", "--out", str(toy / "shipped")]) == 0
    carried, work = tmp_path / ".gpu", tmp_path / "work"
    manifest = script.bundle(toy / "target", packed, questions, carried, 10_000_000, kind="answers")
    assert manifest["calls"] == 1
    command = _device(_only(carried, 1, tmp_path), work, tmp_path / "out", toy, "--tests-s", "0")
    command[command.index("data,drafter,tau")] = "data,drafter-shipped,tau"
    command[command.index("cpu")] = "auto"  # the device run's default: CUDA where visible, here the CPU
    run = subprocess.run(command, env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:]
    assert "--answers" in run.stdout and "--prompts" not in run.stdout
    summary = json.loads((work / "out" / "summary.json").read_text())
    assert {name: r["status"] for name, r in summary["phases"].items()} == dict.fromkeys(
        ["target", "data", "drafter-shipped", "tau"], "ok")
    records = [json.loads(line) for shard in sorted((work / "run" / "runs" / "data").glob("shard-*.jsonl"))
               for line in shard.read_text().splitlines()]
    assert [r["response_token_ids"] for r in records] == [a["answer_ids"] for a in answers[:len(records)]]
    assert len(records) == 24  # --tiny reads the first 24
    assert summary["verdicts"]["greedy_tau_by_line"]["shipped"]["greedy_tau@4"] >= 1.0


def test_the_background_tests_are_ended_with_every_process_they_started(script, tmp_path):
    shell = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True)
    (tmp_path / script.TESTS_PID).write_text(str(shell.pid))
    time.sleep(0.3)
    assert script._group_alive(shell.pid)
    script.stop_tests(tmp_path, 0)
    shell.wait(timeout=10)
    assert not script._group_alive(shell.pid)  # the workers too, not the parent alone
    assert (tmp_path / script.TESTS_PID).read_text() == "ended"
