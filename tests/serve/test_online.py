"""Online distillation on tiny Llamas: the replay buffer is bounded and written atomically, recorded p lines up
with the served tokens, a candidate replaces the drafter only when it agrees with p more often, a restart resumes,
and greedy fp32 output equals plain decoding while the drafter changes under it."""

import json
import os
import re
import time
from types import SimpleNamespace

import httpx
import pytest
import torch
from running import RunningServer

from specdraft.api import eos_token_ids, load_target
from specdraft.batching import BatchDecoder, drafter_factory
from specdraft.decoding import generate
from specdraft.drafters import load_drafter
from specdraft.errors import SpecdraftError
from specdraft.sequence import GenerationConfig
from specdraft.serve import OnlineDistillConfig, ServeConfig, build_server_app, online
from specdraft.serve.online import OnlineDistiller
from specdraft.serve.replay import ReplayBuffer, VerifiedRecorder

PROMPTS = [[1, 5, 6, 7, 5, 6], [1, 9, 10, 11], [1, 4, 4, 8, 12, 13, 4], [1, 20, 21, 22, 20], [1, 7, 3, 7, 3]]


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    from toys import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("draft") / "draft", seed=3, layers=1)


@pytest.fixture(scope="module")
def models(tiny_checkpoint, tiny_draft):
    target, tokenizer = load_target(str(tiny_checkpoint))
    return target, tokenizer, load_drafter(target, tokenizer, str(tiny_draft))


def _served_records(target, drafter, tokens: int = 24) -> list[dict]:
    """Greedy generations of PROMPTS (twice each) through the batch decoder, recorded as the server records them."""
    recorder = VerifiedRecorder(top_k=8)
    decoder = BatchDecoder(target, 4, 64)
    decoder.on_verify = lambda seq, p, missed, proposed: recorder.on_verify(seq, p, missed)
    make, records, waiting = drafter_factory(drafter), [], PROMPTS * 2
    while waiting or decoder.rows:
        while waiting and decoder.free_rows:
            decoder.add(waiting.pop(0), make(), GenerationConfig(tokens, 3))
        for seq, _ in decoder.step():
            if seq.finish_reason is not None:
                records.append(recorder.finish(seq))
    return records


def test_replay_buffer_is_bounded_atomic_and_resumes(tmp_path, monkeypatch):
    buffer = ReplayBuffer(tmp_path, max_records=3, heldout_every=2)
    for i in range(5):
        buffer.add({"i": i})
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rec-00000000{i}.json" for i in (2, 3, 4)]
    train, heldout = buffer.records()
    assert [r["i"] for r in train] == [2, 4] and [r["i"] for r in heldout] == [3]

    class Killed(BaseException):  # a kill, not an error: nothing runs that could remove the temporary file
        pass

    def crash(src, dst):
        raise Killed

    monkeypatch.setattr(os, "replace", crash)  # the write is cut between the temporary file and the rename
    with pytest.raises(Killed):
        buffer.add({"i": 5})
    monkeypatch.undo()
    assert len(list(tmp_path.glob(".rec-*.tmp"))) == 1 and not (tmp_path / "rec-000000005.json").exists()
    reopened = ReplayBuffer(tmp_path, max_records=3, heldout_every=2)
    assert not list(tmp_path.glob(".*.tmp")) and len(reopened) == 3
    assert reopened.add({"i": 6}) == 5
    train, heldout = reopened.records()
    assert [r["i"] for r in train] == [4] and [r["i"] for r in heldout] == [3, 6]
    assert len(reopened) == 3 and not (tmp_path / "rec-000000002.json").exists()


def test_recorded_p_lines_up_with_the_served_tokens(models):
    target, _, drafter = models
    records = _served_records(target, drafter)
    assert len(records) == 2 * len(PROMPTS)
    for record in records:
        greedy = generate(target, record["prompt_token_ids"], None, GenerationConfig(24, 1)).token_ids
        assert record["response_token_ids"] == greedy
        assert [row[0] for row in record["top_ids"]] == greedy  # greedy: the committed token is p's top-1
        assert len(record["top_logprobs"]) == len(greedy) == len(record["missed"])
        assert all(row == sorted(row, reverse=True) and row[0] <= 0 for row in record["top_logprobs"])
    assert any(any(record["missed"]) for record in records)


def test_a_stop_token_committed_without_a_forward_ends_the_record_before_it():
    """The grammar's certain stop token joins ``generated`` without a verify forward: the record keeps the verified
    positions (instead of being dropped whole) and ends before that token."""
    recorder = VerifiedRecorder(top_k=2)
    seq = SimpleNamespace(prompt=torch.tensor([1, 5]), generated=[])
    recorder.on_verify(seq, torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]]), missed=False)  # tokens 1, then 0
    seq.generated = [1, 0, 2]  # 2: the stop token, committed without a forward
    record = recorder.finish(seq)
    assert record["response_token_ids"] == [1, 0] and [row[0] for row in record["top_ids"]] == [1, 0]
    assert len(record["top_logprobs"]) == len(record["missed"]) == 2


def _distiller(folder, drafter, base: str, **options) -> OnlineDistiller:
    config = OnlineDistillConfig(folder=str(folder), heldout_every=2, top_k=8, **options)
    return OnlineDistiller(config, drafter, base, drafter_factory, pad_id=2)


def _fill(distiller, records) -> None:
    for record in records:
        distiller.buffer.add(record)


def test_a_candidate_is_swapped_in_only_when_it_agrees_more_and_a_restart_resumes(models, tiny_draft, tmp_path,
                                                                                  monkeypatch):
    target, _, drafter = models
    records = _served_records(target, drafter)
    distiller = _distiller(tmp_path, drafter, str(tiny_draft), steps=40, lr=3e-2, batch_size=4)
    _fill(distiller, records)
    before = distiller.make_drafter()
    assert before.online_version == 0 and before.model is not None

    worse = lambda model, records, **kw: _scrambled(model)  # noqa: E731
    monkeypatch.setattr(online, "finetune_copy", worse)
    entry = distiller.train_round()
    assert not entry["accepted"] and distiller.version == 0
    assert entry["candidate_agreement"] < entry["current_agreement"]
    monkeypatch.undo()

    entry = distiller.train_round()
    assert entry["accepted"] and entry["candidate_agreement"] > entry["current_agreement"]
    assert distiller.version == 1 and distiller.make_drafter().online_version == 1
    served = distiller.make_drafter().model
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["version"] == 1 and [e["accepted"] for e in state["history"]] == [False, True]
    assert sorted(p.name for p in tmp_path.glob("drafter-v*")) == ["drafter-v1.safetensors"]

    stale = [tmp_path / ".drafter-v2.safetensors.4242.tmp", tmp_path / ".state.json.4242.tmp"]  # writes a kill cut
    for path in stale:
        path.write_bytes(b"half")
    resumed = _distiller(tmp_path, drafter, str(tiny_draft))
    assert resumed.version == 1 and len(resumed.history) == 2 and len(resumed.buffer) == len(records)
    assert not any(path.exists() for path in stale)
    again = resumed.make_drafter().model
    assert all(torch.equal(a, b) for a, b in zip(served.parameters(), again.parameters(), strict=True))
    with pytest.raises(SpecdraftError, match="continues drafter"):
        _distiller(tmp_path, drafter, "another-drafter")


def _scrambled(model):
    """A copy whose logits are all equal: it always drafts token 0, which the target never picks first here."""
    import copy

    worse = copy.deepcopy(model)
    with torch.no_grad():
        worse.model.norm.weight.zero_()
    return worse


def test_online_distillation_needs_a_draft_model(tiny_checkpoint, tmp_path):
    with pytest.raises(SpecdraftError, match="--draft"):
        ServeConfig(target=str(tiny_checkpoint), drafter="prompt-lookup",
                    online_distill=OnlineDistillConfig(folder=str(tmp_path)))
    with pytest.raises(SpecdraftError, match="loss"):
        OnlineDistillConfig(folder=str(tmp_path), loss="ce")
    target, tokenizer = load_target(str(tiny_checkpoint))
    with pytest.raises(SpecdraftError, match="trains a draft model"):
        _distiller(tmp_path, load_drafter(target, tokenizer, None, "prompt-lookup"), "x")


def test_greedy_output_is_unchanged_while_the_drafter_is_retrained(tiny_checkpoint, tiny_draft, tmp_path):
    online = OnlineDistillConfig(folder=str(tmp_path), every_tokens=40, steps=20, lr=3e-2, heldout_every=2, top_k=8)
    config = ServeConfig(target=str(tiny_checkpoint), draft=str(tiny_draft), served_model_name="tiny", max_batch=3,
                         max_prompt_tokens=32, max_tokens=24, online_distill=online)
    target, tokenizer = load_target(str(tiny_checkpoint))
    eos = eos_token_ids(tokenizer, str(tiny_checkpoint))
    expected = {tuple(p): generate(target, p, None, GenerationConfig(24, 1, eos_token_ids=eos)).token_ids
                for p in PROMPTS}
    served_by_new_version = 0
    with RunningServer(build_server_app(config)) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(10):  # rounds of traffic until a full round was drafted by a retrained drafter
            swapped = "specdraft_online_drafter_version 0" not in client.get("/metrics").text
            for prompt in PROMPTS:
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0}
                reply, greedy = client.post("/v1/completions", json=body).json(), expected[tuple(prompt)]
                assert reply["choices"][0]["text"] == tokenizer.decode(greedy, skip_special_tokens=True)
                assert reply["usage"]["completion_tokens"] == len(greedy)
            served_by_new_version += swapped
            if served_by_new_version:
                break
            rounds = _rounds(client)
            deadline = time.monotonic() + 30
            while _rounds(client) == rounds and time.monotonic() < deadline:  # let the trainer catch up
                time.sleep(0.2)
        metrics = client.get("/metrics").text
    assert served_by_new_version and 'specdraft_online_acceptance_rate{version="0"}' in metrics
    assert re.search(r'specdraft_online_acceptance_rate\{version="[1-9]\d*"\}', metrics)  # a retrained version served
    assert list((tmp_path / "buffer").glob("rec-*.json"))


def _rounds(client) -> int:
    line = next(line for line in client.get("/metrics").text.splitlines() if line.startswith("specdraft_online_rounds"))
    return int(float(line.split()[-1]))
