"""Distillation data: batched with left padding, exactly once per prompt, resumable after kill -9."""

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.training.data.distill_data import DistillDataConfig, generate_distillation_data, shard_path
from toys import save_tiny_checkpoint


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("target") / "t", seed=0))


def _prompt_file(path, n):
    lines = [json.dumps({"prompt": " ".join(f"w{(i * 7 + j) % 60}" for j in range(1 + i % 5))}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _records(out):
    return [json.loads(line) for f in sorted(out.glob("shard-*.jsonl")) for line in f.read_text().splitlines()]


def _config(target, prompts, out, **kwargs):
    defaults = dict(max_new_tokens=6, batch_size=3, shard_size=4, dtype="float32", temperature=0.0)
    return DistillDataConfig(target=target, out=str(out), prompts=prompts, **(defaults | kwargs))


def test_every_prompt_answered_once_with_valid_records(target, tmp_path):
    prompts = _prompt_file(tmp_path / "p.jsonl", 10)
    manifest = generate_distillation_data(_config(target, prompts, tmp_path / "out", temperature=1.0,
                                                  responses_per_prompt=2, top_logprobs=3), progress=False)
    assert manifest["complete"] and manifest["num_shards"] == 3 and manifest["records"] == 20
    records = _records(tmp_path / "out")
    assert Counter(r["prompt_id"] for r in records) == {f"p.jsonl:{i}": 2 for i in range(10)}
    for r in records:
        assert 1 <= len(r["response_token_ids"]) <= 6
        assert len(r["top_ids"]) == len(r["top_logprobs"]) == len(r["response_token_ids"])
        assert all(len(row) == 3 and row == sorted(row, reverse=True) for row in r["top_logprobs"])
        assert r["messages"][0]["role"] == "user" and r["sampling"]["temperature"] == 1.0


def test_left_padded_batches_equal_unbatched_greedy(target, tmp_path):
    prompts = _prompt_file(tmp_path / "p.jsonl", 7)  # prompts of 1..5 words: padding differs within a batch
    generate_distillation_data(_config(target, prompts, tmp_path / "b", batch_size=4), progress=False)
    generate_distillation_data(_config(target, prompts, tmp_path / "u", batch_size=1), progress=False)
    batched, single = _records(tmp_path / "b"), _records(tmp_path / "u")
    assert [r["response_token_ids"] for r in batched] == [r["response_token_ids"] for r in single]


def test_resume_regenerates_only_missing_shards_and_rejects_other_settings(target, tmp_path):
    prompts = _prompt_file(tmp_path / "p.jsonl", 9)
    config = _config(target, prompts, tmp_path / "out")
    generate_distillation_data(config, progress=False)
    out = tmp_path / "out"
    kept = shard_path(out, 0).stat().st_mtime_ns
    before = _records(out)
    shard_path(out, 1).unlink()
    manifest = generate_distillation_data(config, progress=False)
    assert manifest["complete"] and _records(out) == before
    assert shard_path(out, 0).stat().st_mtime_ns == kept
    with pytest.raises(SpecdraftError, match="max_new_tokens"):
        generate_distillation_data(_config(target, prompts, out, max_new_tokens=9), progress=False)


def test_bad_settings_and_empty_prompt_file(target, tmp_path):
    with pytest.raises(SpecdraftError, match="top_p"):
        _config(target, "x", tmp_path, top_p=0)
    with pytest.raises(SpecdraftError, match="shard_size"):
        _config(target, "x", tmp_path, shard_size=0)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(SpecdraftError):
        generate_distillation_data(_config(target, str(tmp_path / "empty.jsonl"), tmp_path / "o"), progress=False)


def test_kill_9_mid_run_then_resume_answers_every_prompt_exactly_once(target, tmp_path):
    prompts = _prompt_file(tmp_path / "p.jsonl", 40)
    out = tmp_path / "out"
    code = ("import sys; "
            "from specdraft.training.data.distill_data import DistillDataConfig, generate_distillation_data; "
            f"generate_distillation_data(DistillDataConfig(target={target!r}, out={str(out)!r}, prompts={prompts!r}, "
            "max_new_tokens=24, batch_size=1, shard_size=2, dtype='float32', temperature=1.0, device='cpu'), "
            "progress=False)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and len(list(out.glob("shard-*.jsonl"))) < 2:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = len(list(out.glob("shard-*.jsonl")))
    assert 2 <= done_before < 20, "the run should have been killed part-way"
    manifest = json.loads((out / "manifest.json").read_text())  # rewritten after each shard: usable part-way
    assert not manifest["complete"] and done_before - 1 <= len(manifest["shards"]) <= done_before
    assert all((out / name).is_file() for name in manifest["shards"])
    (out / ".shard-00019.jsonl.999.tmp").write_text("{\"partial")  # what a kill mid-write leaves
    config = DistillDataConfig(target=target, out=str(out), prompts=prompts, max_new_tokens=24, batch_size=1,
                               shard_size=2, dtype="float32", temperature=1.0)
    manifest = generate_distillation_data(config, progress=False)
    assert manifest["complete"] and manifest["records"] == 40
    assert Counter(r["prompt_id"] for r in _records(out)) == {f"p.jsonl:{i}": 1 for i in range(40)}
    assert not list(out.glob(".*.tmp"))


def test_torchrun_two_ranks_split_prompts_exactly_once(target, tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    prompts = _prompt_file(tmp_path / "p.jsonl", 11)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           "-m", "specdraft.cli", "distill-data", "--target", target, "--out", str(out), "--prompts", prompts,
           "--shard-size", "2", "--max-new-tokens", "4", "--dtype", "float32", "--temperature", "0", "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                          env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["num_shards"] == 6 and manifest["records"] == 11
    assert Counter(r["prompt_id"] for r in _records(out)) == {f"p.jsonl:{i}": 1 for i in range(11)}
    assert proc.stdout.count('"complete": true') == 1  # only rank 0 reports


def test_native_engine_answers_as_transformers_does_in_float32(target, tmp_path):
    """Greedy, fp32: the same responses and log-probabilities as the left-padded transformers path; records alike."""
    prompts = _prompt_file(tmp_path / "p.jsonl", 7)
    generate_distillation_data(_config(target, prompts, tmp_path / "hf", batch_size=4, top_logprobs=3), progress=False)
    manifest = generate_distillation_data(_config(target, prompts, tmp_path / "nat", batch_size=4, top_logprobs=3,
                                                  engine="native"), progress=False)
    assert manifest["complete"] and manifest["config"]["engine"] == "native"
    hf, native = _records(tmp_path / "hf"), _records(tmp_path / "nat")
    assert [r["response_token_ids"] for r in native] == [r["response_token_ids"] for r in hf]
    assert [r["finish_reason"] for r in native] == [r["finish_reason"] for r in hf]
    for a, b in zip(native, hf, strict=True):
        assert a["top_ids"] == b["top_ids"] and set(a) == set(b)
        gap = torch.tensor(a["top_logprobs"]) - torch.tensor(b["top_logprobs"])  # (R, k)
        assert gap.abs().max() < 1e-4


def test_native_engine_samples_reproducibly_and_stops_rows_at_eos(target, tmp_path):
    from specdraft.models.registry import load_model
    from specdraft.sampling import SamplingConfig
    from specdraft.training.data.native_generation import generate_rows

    model = load_model(target, backend="native")
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [5, 6, 7]]
    sampling = SamplingConfig(temperature=1.0)
    eos = 5  # with this seed some rows end at it and some run to the length cap
    first = generate_rows(model, prompts, 12, sampling, eos=eos, top_logprobs=2,
                          generator=torch.Generator().manual_seed(1))
    again = generate_rows(model, prompts, 12, sampling, eos=eos, top_logprobs=2,
                          generator=torch.Generator().manual_seed(1))
    assert first == again
    assert {r["finish_reason"] for r in first} == {"eos", "length"}
    for response in first:
        ids = response["ids"]
        assert 1 <= len(ids) <= 12 and len(response["top_ids"]) == len(ids)
        assert (response["finish_reason"] == "eos") == (ids[-1] == eos) and eos not in ids[:-1]
        assert response["finish_reason"] == "eos" or len(ids) == 12
    greedy = generate_rows(model, prompts, 12, SamplingConfig(), eos=eos, top_logprobs=0, generator=None)
    assert {r["finish_reason"] for r in greedy} == {"eos", "length"}
    alone = [generate_rows(model, [p], 12, SamplingConfig(), eos=eos, top_logprobs=0, generator=None)[0]
             for p in prompts]
    assert greedy == alone  # rows leaving the batch never disturb the others


def test_native_engine_refuses_on_policy_data(target, tmp_path):
    with pytest.raises(SpecdraftError, match="--engine native"):
        _config(target, "sharegpt", tmp_path / "o", engine="native", policy="draft", draft=target)


def test_answers_made_elsewhere_become_the_usual_records_with_the_targets_top_k(target, tmp_path):
    """distill-data --answers: the prompts and answer ids of a .jsonl.gz give the records the target would have
    written itself (greedy, fp32), its top-k added by teacher forcing; an edited file is refused on rerun."""
    import gzip

    prompts = _prompt_file(tmp_path / "p.jsonl", 7)
    generate_distillation_data(_config(target, prompts, tmp_path / "made", top_logprobs=3), progress=False)
    made = _records(tmp_path / "made")
    answers = tmp_path / "answers.jsonl.gz"
    lines = [json.dumps({"prompt": r["messages"][0]["content"], "answer_ids": r["response_token_ids"]}) for r in made]
    answers.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    config = _config(target, "sharegpt", tmp_path / "given", answers=str(answers), top_logprobs=3)
    manifest = generate_distillation_data(config, progress=False)
    given = _records(tmp_path / "given")
    assert manifest["complete"] and manifest["records"] == 7 and manifest["config"]["answers"] == str(answers)
    for a, b in zip(given, made, strict=True):
        for key in ("messages", "prompt_token_ids", "response_token_ids", "finish_reason", "response_text", "top_ids"):
            assert a[key] == b[key], key
        assert (torch.tensor(a["top_logprobs"]) - torch.tensor(b["top_logprobs"])).abs().max() < 1e-3
    lines[0] = json.dumps({"prompt": "w1 w2", "answer_ids": [3, 4]})
    answers.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    with pytest.raises(SpecdraftError, match="prompts"):
        generate_distillation_data(config, progress=False)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "w1", "answer_ids": []}) + "\n")
    with pytest.raises(SpecdraftError, match="answer_ids"):
        generate_distillation_data(_config(target, "sharegpt", tmp_path / "bad", answers=str(tmp_path / "bad.jsonl")),
                                   progress=False)
    with pytest.raises(SpecdraftError, match="--answers"):
        _config(target, prompts, tmp_path / "both", answers=str(answers))


def test_prompts_are_encoded_as_the_chat_template_encodes_them_one_by_one(target):
    from specdraft.models.registry import cache_dir, load_tokenizer
    from specdraft.prompts import encode_prompts

    conversations = [[{"role": "user", "content": "Hello <|im_end|> there"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "w1 w2\n\nw3"}],
                     [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                      {"role": "user", "content": "  spaced  "}]]
    real = "smollm2-135m-instruct"  # the shipped target's template and tokenizer, where it is converted already
    for name in [target] + ([real] if (cache_dir() / real / "tokenizer.json").is_file() else []):
        tokenizer = load_tokenizer(name)
        expected = [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=True)["input_ids"])
                    for c in conversations]
        assert encode_prompts(tokenizer, conversations) == expected
    assert encode_prompts(tokenizer, []) == []
