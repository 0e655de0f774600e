"""``distill-data --engine vllm`` without vLLM: a stand-in ``vllm`` package computing with transformers
(tests/fake_vllm) checks that the records are the native engine's (fields, tokens, top-k), that sampling is
seeded per prompt, that resume, fingerprints and refusals work as for the other engines, and that a kill -9
leaves no engine behind and a rerun answers every prompt once. tests/engines/test_vllm_exports.py runs the
real engine."""

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from fake_vllm import fake_vllm_python
from specdraft.errors import SpecdraftError
from specdraft.training.data.distill_data import DistillDataConfig, generate_distillation_data
from specdraft.training.data.vllm_generation import response, sampling_fields
from toys import save_tiny_checkpoint


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("target") / "t", seed=0))


@pytest.fixture
def fake(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_VLLM_PYTHON", str(fake_vllm_python(tmp_path / "venv")))


@pytest.fixture(scope="module")
def engine(target, tmp_path_factory):
    """One stand-in engine for the tests that pass it in (``models``), as ``finetune --regenerate-every`` does."""
    from specdraft.models.registry import load_tokenizer
    from specdraft.training.data.vllm_generation import start_engine

    python = fake_vllm_python(tmp_path_factory.mktemp("venv"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDRAFT_VLLM_PYTHON", str(python))
        engine = start_engine(_config(target, "x", "o", engine="vllm", top_logprobs=4))
    yield engine, load_tokenizer(target), None
    engine.close()


def _prompts(path, n):
    path.write_text("".join(json.dumps({"prompt": " ".join(f"w{(i * 7 + j) % 60}" for j in range(1 + i % 5))}) + "\n"
                            for i in range(n)))
    return str(path)


def _records(out):
    return [json.loads(line) for f in sorted(out.glob("shard-*.jsonl")) for line in f.read_text().splitlines()]


def _config(target, prompts, out, **kwargs):
    defaults = dict(max_new_tokens=6, batch_size=3, shard_size=4, dtype="float32", temperature=0.0)
    return DistillDataConfig(target=target, out=str(out), prompts=prompts, **(defaults | kwargs))


def test_records_equal_the_native_engines_in_float32(engine, target, tmp_path):
    prompts = _prompts(tmp_path / "p.jsonl", 6)
    native = generate_distillation_data(_config(target, prompts, tmp_path / "n", engine="native", top_logprobs=4),
                                        progress=False)
    vllm = generate_distillation_data(_config(target, prompts, tmp_path / "v", engine="vllm", top_logprobs=4),
                                      progress=False, models=engine)
    assert vllm["complete"] and vllm["records"] == native["records"] == 6 and vllm["config"]["engine"] == "vllm"
    ours, theirs = _records(tmp_path / "v"), _records(tmp_path / "n")
    for a, b in zip(ours, theirs, strict=True):
        assert sorted(a) == sorted(b)
        assert a | {"top_logprobs": None} == b | {"top_logprobs": None}
        flat = lambda rows: [v for row in rows for v in row]  # noqa: E731
        assert flat(a["top_logprobs"]) == pytest.approx(flat(b["top_logprobs"]), abs=1e-4)


def test_sampled_answers_are_seeded_per_prompt_and_resume(engine, target, tmp_path):
    prompts = _prompts(tmp_path / "p.jsonl", 5)
    config = _config(target, prompts, tmp_path / "s", engine="vllm", temperature=1.0, responses_per_prompt=2,
                     greedy_response=True)
    manifest = generate_distillation_data(config, progress=False, models=engine)
    records = _records(tmp_path / "s")
    assert manifest["complete"] and len(records) == 15
    assert Counter(r["prompt_id"] for r in records) == {f"p.jsonl:{i}": 3 for i in range(5)}
    assert [r["response_index"] for r in records[:3]] == [0, 1, 2]
    (tmp_path / "s" / "shard-00001.jsonl").unlink()  # a shard lost: made again, the same way
    assert generate_distillation_data(config, progress=False, models=engine)["complete"]
    assert _records(tmp_path / "s") == records
    with pytest.raises(SpecdraftError, match="engine"):
        generate_distillation_data(_config(target, prompts, tmp_path / "s", temperature=1.0, responses_per_prompt=2,
                                           greedy_response=True, engine="native"), progress=False)


def test_refusals(target, tmp_path, monkeypatch):
    with pytest.raises(SpecdraftError, match="--engine vllm generates the target's answers only"):
        _config(target, "x", tmp_path, engine="vllm", policy="draft", draft=target)
    with pytest.raises(SpecdraftError, match="tensor_parallel"):
        _config(target, "x", tmp_path, engine="native", tensor_parallel=2)
    monkeypatch.setenv("SPECDRAFT_VLLM_PYTHON", str(tmp_path / "none"))
    prompts = _prompts(tmp_path / "p.jsonl", 2)
    with pytest.raises(SpecdraftError, match="make engines"):
        generate_distillation_data(_config(target, prompts, tmp_path / "o", engine="vllm"), progress=False)


def test_a_completion_becomes_a_response():
    config = _config("t", "x", "o", top_logprobs=2)
    done = {"ids": [5, 2], "finish_reason": "stop", "top_ids": [[5, 6], [2, 7]],
            "top_logprobs": [[-0.1, -2], [-0.2, -3]]}
    assert response(done, 2, 2) == {"ids": [5, 2], "finish_reason": "eos", "top_ids": [[5, 6], [2, 7]],
                                    "top_logprobs": [[-0.1, -2], [-0.2, -3]]}
    assert response({"ids": [5], "finish_reason": "stop"}, 2, 0) == {"ids": [5, 2], "finish_reason": "eos"}
    assert response({"ids": [5, 6], "finish_reason": "length"}, 2, 0)["finish_reason"] == "length"
    with pytest.raises(SpecdraftError, match="finish_reason 'abort'"):
        response({"ids": [5], "finish_reason": "abort"}, 2, 0)
    with pytest.raises(SpecdraftError, match="fewer than 2"):
        response(done | {"top_ids": [[5], [2]]}, 2, 2)
    fields = sampling_fields(config, 2, 11)
    assert fields["temperature"] == 0.0 and fields["logprobs"] == 2 and fields["stop_token_ids"] == [2]
    assert fields["seed"] == 11 and fields["detokenize"] is False and fields["max_tokens"] == 6


def test_kill_9_leaves_no_engine_and_a_rerun_answers_every_prompt_once(fake, engine, target, tmp_path):
    prompts = _prompts(tmp_path / "p.jsonl", 12)
    out = tmp_path / "out"
    argv = ["distill-data", "--target", target, "--out", str(out), "--prompts", prompts, "--engine", "vllm",
            "--shard-size", "4", "--max-new-tokens", "4", "--dtype", "float32", "--temperature", "0", "--device", "cpu"]
    code = f"import sys; from specdraft.cli import main; sys.exit(main({argv!r}))"
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path), "FAKE_VLLM_SLOW_AFTER": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (out / "shard-00000.jsonl").is_file():
        time.sleep(0.1)
    workers = _workers(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (out / "shard-00000.jsonl").is_file() and not (out / "shard-00002.jsonl").is_file()
    assert workers, "the engine should have been running"
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_alive(pid) for pid in workers):
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in workers)
    manifest = generate_distillation_data(_config(target, prompts, out, engine="vllm", max_new_tokens=4,
                                                  batch_size=16), progress=False, models=engine)
    assert manifest["complete"] and manifest["records"] == 12
    assert Counter(r["prompt_id"] for r in _records(out)) == {f"p.jsonl:{i}": 1 for i in range(12)}


def _workers(parent: int) -> list[int]:
    children = open(f"/proc/{parent}/task/{parent}/children").read().split()
    return [int(pid) for pid in children]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
