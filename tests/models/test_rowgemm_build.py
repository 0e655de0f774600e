"""Building the row-product kernel: what it needs from the environment."""

import subprocess
import sys
import time

from specdraft.models import rowgemm


def test_ninja_beside_the_interpreter_goes_on_path(tmp_path, monkeypatch):
    """An unactivated environment (``.venv/bin/python``) still finds the ninja its wheel installed."""
    (tmp_path / "ninja").write_text("")
    monkeypatch.setattr(rowgemm.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", "/nowhere")
    rowgemm._put_ninja_on_path()
    rowgemm._put_ninja_on_path()  # once only
    assert rowgemm.os.environ["PATH"].split(rowgemm.os.pathsep) == [str(tmp_path), "/nowhere"]


def test_a_build_lock_left_by_a_killed_build_is_removed_under_the_flock(tmp_path):
    """torch's build lock is a plain file: one left by a killed build would make the next process wait for its removal
    forever. Under specdraft's ``flock`` no other build runs, so the file is known stale and removed before loading."""
    (tmp_path / "lock").write_text("")  # what a build killed after taking torch's lock leaves
    with rowgemm._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_the_build_lock_is_held_by_one_process_at_a_time(tmp_path):
    """While one process holds the build lock of a folder, another waits; the system releases it when its holder
    dies, so a killed build never blocks the next one."""
    hold = ("import sys, time; from pathlib import Path; from specdraft.models import rowgemm\n"
            "with rowgemm._build_lock(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        waiter = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        try:
            time.sleep(2.0)
            assert waiter.poll() is None
            holder.kill()  # SIGKILL: no cleanup runs in the holder
            holder.wait()
            assert waiter.stdout.readline().strip() == "held"
        finally:
            waiter.kill()
            waiter.wait()
    finally:
        holder.kill()
        holder.wait()
