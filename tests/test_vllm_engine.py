"""The vLLM worker and its client without vLLM: a stand-in ``vllm`` package (transformers underneath) checks the
protocol, the folder views, the environment, start failures, and that the worker dies with a killed parent.
tests/engines/test_vllm_exports.py runs the real engine."""

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from fake_vllm import fake_vllm_python
from specdraft.engines.vllm import (
    EngineSettings,
    VllmEngine,
    loadable_folder,
    user_arguments,
    vllm_python,
    worker_environment,
)
from specdraft.errors import SpecdraftError
from toys import save_tiny_checkpoint


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("target") / "t", seed=0)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    python = fake_vllm_python(tmp_path / "venv")
    monkeypatch.setenv("SPECDRAFT_VLLM_PYTHON", str(python))
    return python


def test_a_missing_environment_names_make_engines(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_VLLM_PYTHON", str(tmp_path / "nothing"))
    with pytest.raises(SpecdraftError, match="make engines"):
        vllm_python()
    monkeypatch.setenv("SPECDRAFT_VLLM_ARGS", "[1]")
    with pytest.raises(SpecdraftError, match="SPECDRAFT_VLLM_ARGS"):
        user_arguments()


def test_a_folder_with_other_safetensors_is_seen_through_a_view(target, tmp_path):
    views = tmp_path / "views"
    views.mkdir()
    assert loadable_folder(target, views) == str(target)  # only model.safetensors
    assert loadable_folder("org/model", views) == "org/model"  # a hub id
    folder = tmp_path / "ranked"
    folder.mkdir()
    for path in target.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    (folder / "token_ranking.safetensors").write_bytes(b"x")
    view = loadable_folder(folder, views)
    names = {p.name for p in (views / view).iterdir()}
    assert "token_ranking.safetensors" not in names and names == {p.name for p in target.iterdir()}
    (folder / "model.safetensors.index.json").write_text("{}")
    assert loadable_folder(folder, views) == str(folder)  # vLLM follows the index


def test_the_worker_environment_keeps_what_the_user_set(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")
    env = worker_environment(EngineSettings("m", kv_cache_gib=1), tmp_path / "bin" / "python", tmp_path / "c")
    assert "PYTHONPATH" not in env and env["HF_HUB_OFFLINE"] == "1" and env["VLLM_CACHE_ROOT"] == str(tmp_path / "c")
    if "VLLM_CPU_OMP_THREADS_BIND" in env:  # a CPU machine
        assert env["VLLM_CPU_KVCACHE_SPACE"] == "7" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, sorted(os.sched_getaffinity(0))))


def test_the_engine_answers_token_ids_with_logprobs_and_counters(fake, target):
    reference = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    prompt = [1, 5, 9, 4]
    plain = reference.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    with VllmEngine(EngineSettings(str(target), dtype="float32", speculative=speculative)) as engine:
        assert engine.version == "0.0-fake"
        answer = engine.generate([prompt], [{"max_tokens": 6, "temperature": 0.0, "logprobs": 3}])
        completion = answer["outputs"][0][0]
        assert completion["ids"] == plain[0, len(prompt):].tolist() and completion["finish_reason"] == "length"
        assert len(completion["top_ids"]) == 6 and all(len(row) == 3 for row in completion["top_ids"])
        assert [row[0] for row in completion["top_ids"]] == completion["ids"]  # greedy: the best token
        assert completion["prefill_seconds"] == pytest.approx(0.25)
        assert completion["spec_decode"]["per_step_drafted"] == [3, 3]
        assert answer["counters"]["vllm:spec_decode_num_draft_tokens"] == 6  # this request's change
        again = engine.generate([prompt], [{"max_tokens": 6, "temperature": 0.0}])
        assert again["counters"]["vllm:spec_decode_num_draft_tokens"] == 6
        with pytest.raises(SpecdraftError, match="vLLM failed: TypeError"):
            engine.generate([prompt], [{"no_such_field": 1}])
        process = engine.process
    assert process.poll() is not None


def test_a_refused_start_is_one_error_with_vllms_message(fake, target, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL_START", "Speculative method 'independent' is not supported")
    with pytest.raises(SpecdraftError, match=r"vLLM refused the engine .*ValueError: Speculative method"):
        VllmEngine(EngineSettings(str(target), dtype="float32"))


def test_the_worker_dies_with_a_killed_parent(fake, target, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_SLEEP", "60")
    code = ("import sys\nfrom specdraft.engines.vllm import EngineSettings, VllmEngine\n"
            f"e = VllmEngine(EngineSettings({str(target)!r}, dtype='float32'))\n"
            "print(e.process.pid, flush=True)\ne.generate([[1, 2]], [{'max_tokens': 2}])\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})
    worker = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and _alive(worker):
        time.sleep(0.2)
    assert not _alive(worker)
    from specdraft.engines.vllm import SCRATCH_PREFIX, remove_stale_scratch

    left = list(Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}{parent.pid}-*"))
    assert left  # the killed process could not clean up
    remove_stale_scratch()
    assert not any(folder.exists() for folder in left)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
