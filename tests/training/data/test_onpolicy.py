"""On-policy distillation data (DistillSpec, GKD): the drafter answers, the target scores every response token."""

import json

import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.models.registry import load_model
from specdraft.training.data.distill_data import DistillDataConfig, generate_distillation_data, shard_path
from specdraft.training.data.onpolicy import draws_from_drafter
from specdraft.training.data.scoring import topk_logprobs
from toys import save_tiny_checkpoint


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return str(save_tiny_checkpoint(root / "target", seed=0)), str(save_tiny_checkpoint(root / "draft", seed=1))


def _prompt_file(path, n):
    lines = [json.dumps({"prompt": " ".join(f"w{(i * 7 + j) % 60}" for j in range(1 + i % 5))}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _records(out):
    return [json.loads(line) for f in sorted(out.glob("shard-*.jsonl")) for line in f.read_text().splitlines()]


def _run(target, prompts, out, **kwargs):
    defaults = dict(max_new_tokens=6, batch_size=3, shard_size=4, dtype="float32", temperature=0.0, top_logprobs=4)
    config = DistillDataConfig(target=target, out=str(out), prompts=prompts, **(defaults | kwargs))
    return generate_distillation_data(config, progress=False), _records(out)


def test_draft_policy_answers_with_the_drafter_and_stores_the_targets_topk(models, tmp_path):
    target, draft = models
    prompts = _prompt_file(tmp_path / "p.jsonl", 7)
    manifest, records = _run(target, prompts, tmp_path / "on", policy="draft", draft=draft)
    _, by_drafter = _run(draft, prompts, tmp_path / "q")  # the drafter's own greedy answers, as a target run
    assert manifest["complete"] and manifest["config"]["policy"] == "draft"
    assert [r["response_token_ids"] for r in records] == [r["response_token_ids"] for r in by_drafter]
    assert all(r["policy"] == "draft" and r["drafter"] == draft for r in records)
    p = load_model(target, torch.float32, backend="hf").model
    for r in records:
        top_ids, top_logprobs = topk_logprobs(p, [r["prompt_token_ids"] + r["response_token_ids"]],
                                              [len(r["prompt_token_ids"])], 4, 0)[0]
        assert r["top_ids"] == top_ids and len(top_ids) == len(r["response_token_ids"])
        assert torch.allclose(torch.tensor(r["top_logprobs"]), torch.tensor(top_logprobs), atol=1e-3)


def test_a_drafter_with_a_draft_vocabulary_answers_inside_it(models, tmp_path):
    """A drafter trained over N tokens answers as it drafts: from those N only (its other logits are untrained)."""
    import shutil

    from specdraft.draft_vocab import save_token_ranking

    _, draft = models
    restricted = tmp_path / "draft-n8"
    shutil.copytree(draft, restricted)
    ranking = torch.randperm(64, generator=torch.Generator().manual_seed(0))  # (V,)
    save_token_ranking(restricted, ranking)
    (restricted / "drafter_options.json").write_text('{"draft_vocab": 8}')
    prompts = _prompt_file(tmp_path / "p.jsonl", 6)
    _, inside = _run(models[0], prompts, tmp_path / "in", policy="draft", draft=str(restricted), temperature=1.0)
    _, free = _run(models[0], prompts, tmp_path / "free", policy="draft", draft=draft, temperature=1.0)
    keep = set(ranking[:8].tolist())
    assert all(t in keep for r in inside for t in r["response_token_ids"])
    assert not all(t in keep for r in free for t in r["response_token_ids"])


def test_drafter_equal_to_target_gives_the_target_data(models, tmp_path):
    """Scoring by teacher forcing agrees with the log-probs kept while the target generates."""
    target, _ = models
    prompts = _prompt_file(tmp_path / "p.jsonl", 6)
    _, on = _run(target, prompts, tmp_path / "on", policy="draft", draft=target)
    _, off = _run(target, prompts, tmp_path / "off")
    assert [r["response_token_ids"] for r in on] == [r["response_token_ids"] for r in off]
    assert [r["top_ids"] for r in on] == [r["top_ids"] for r in off]
    for a, b in zip(on, off, strict=True):
        assert torch.allclose(torch.tensor(a["top_logprobs"]), torch.tensor(b["top_logprobs"]), atol=1e-3)
    assert {r["policy"] for r in off} == {"target"}


def test_mixed_policy_draws_each_prompt_once_reproducibly(models, tmp_path):
    target, draft = models
    prompts = _prompt_file(tmp_path / "p.jsonl", 12)
    manifest, mixed = _run(target, prompts, tmp_path / "mix", policy="mixed", mix_fraction=0.5, draft=draft, seed=3)
    _, on = _run(target, prompts, tmp_path / "on", policy="draft", draft=draft)
    _, off = _run(target, prompts, tmp_path / "off")
    assert manifest["config"]["mix_fraction"] == 0.5
    policies = [r["policy"] for r in mixed]
    assert policies == ["draft" if draws_from_drafter(r["prompt_id"], "mixed", 0.5, 3) else "target" for r in mixed]
    assert 0 < policies.count("draft") < len(mixed)
    for record, a, b in zip(mixed, on, off, strict=True):
        same = a if record["policy"] == "draft" else b
        assert record["response_token_ids"] == same["response_token_ids"] and record["top_ids"] == same["top_ids"]
    shard_path(tmp_path / "mix", 1).unlink()  # resume: the missing shard is remade with the same draws
    _, again = _run(target, prompts, tmp_path / "mix", policy="mixed", mix_fraction=0.5, draft=draft, seed=3)
    assert again == mixed


def test_torchrun_two_ranks_make_the_same_mixed_data_as_one_process(models, tmp_path):
    """The mixed policy's draws and the drafter's answers do not depend on the rank that makes a shard (the CLI,
    under torchrun)."""
    import os
    import socket
    import subprocess
    import sys

    target, draft = models
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    prompts = _prompt_file(tmp_path / "p.jsonl", 9)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           "-m", "specdraft.cli", "distill-data", "--target", target, "--out", str(tmp_path / "ranks"), "--prompts",
           prompts, "--shard-size", "2", "--batch-size", "3", "--max-new-tokens", "6", "--dtype", "float32",
           "--temperature", "0", "--top-logprobs", "4", "--policy", "mixed", "--mix-fraction", "0.5", "--draft",
           draft, "--seed", "3", "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    _, single = _run(target, prompts, tmp_path / "one", policy="mixed", mix_fraction=0.5, draft=draft, seed=3,
                     shard_size=2)
    ranks = _records(tmp_path / "ranks")
    assert [(r["prompt_id"], r["policy"], r["response_token_ids"], r["top_ids"]) for r in ranks] == [
        (r["prompt_id"], r["policy"], r["response_token_ids"], r["top_ids"]) for r in single]
    assert {r["policy"] for r in ranks} == {"draft", "target"}


def test_mix_fraction_endpoints_and_rate():
    ids = [f"p:{i}" for i in range(2000)]
    assert not any(draws_from_drafter(i, "mixed", 0.0, 0) for i in ids)
    assert all(draws_from_drafter(i, "mixed", 1.0, 0) for i in ids)
    assert 0.27 < sum(draws_from_drafter(i, "mixed", 0.3, 0) for i in ids) / len(ids) < 0.33
    assert [draws_from_drafter(i, "mixed", 0.5, 0) for i in ids] != [draws_from_drafter(i, "mixed", 0.5, 1)
                                                                      for i in ids]


def test_greedy_response_beside_sampled_ones(models, tmp_path):
    target, draft = models
    prompts = _prompt_file(tmp_path / "p.jsonl", 5)
    _, records = _run(target, prompts, tmp_path / "g", policy="draft", draft=draft, temperature=1.0,
                      responses_per_prompt=2, greedy_response=True)
    _, greedy = _run(target, prompts, tmp_path / "q", policy="draft", draft=draft)
    assert len(records) == 15 and [r["response_index"] for r in records] == [0, 1, 2] * 5
    assert [r["response_token_ids"] for r in records[::3]] == [r["response_token_ids"] for r in greedy]
    assert [r["sampling"]["temperature"] for r in records[:3]] == [0.0, 1.0, 1.0]
    assert all(len(r["top_ids"]) == len(r["response_token_ids"]) for r in records)


def test_default_settings_keep_the_saved_fields_of_older_folders(models):
    config = DistillDataConfig(target="t", out="o")
    assert set(config.data_fields()) == {"target", "prompts", "split", "limit", "responses_per_prompt",
                                         "max_new_tokens", "temperature", "top_p", "top_k", "top_logprobs",
                                         "shard_size", "dtype", "seed"}


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(policy="student"), "policy must be one of"),
    (dict(policy="draft"), "--draft"),
    (dict(policy="mixed", draft="d", mix_fraction=1.5), "mix_fraction"),
    (dict(temperature=0.0, greedy_response=True), "greedy-response"),
    (dict(temperature=0.0, responses_per_prompt=3), "responses-per-prompt 1"),
])
def test_bad_policy_settings(kwargs, message):
    with pytest.raises(SpecdraftError, match=message):
        DistillDataConfig(target="t", out="o", **kwargs)


@pytest.mark.slow
def test_smollm2_shipped_drafter_answers_and_the_target_scores(tmp_path):
    """The real target and the shipped drafter on two prompts: the records hold the drafter's greedy answers from
    its draft vocabulary and the target's top-k at every one of their tokens."""
    from specdraft.api import load_draft_model
    from specdraft.draft_vocab import draft_subset
    from specdraft.models.registry import SMOLLM2, load_tokenizer, resolve

    drafter_name = "smollm2-135m-instruct-drafter"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "What is the capital of France?"}\n{"prompt": "Give me two tips for sleep."}\n')
    _, records = _run(SMOLLM2, str(prompts), tmp_path / "on", policy="draft", draft=drafter_name, max_new_tokens=12,
                      top_logprobs=8)
    assert [r["policy"] for r in records] == ["draft", "draft"]
    target, tokenizer = load_model(SMOLLM2, torch.float32, backend="hf"), load_tokenizer(SMOLLM2)
    drafter = load_draft_model(target, tokenizer, drafter_name, backend="hf").model
    keep = draft_subset(str(resolve(drafter_name)), 49152, 8192)  # (N,): the shipped draft_vocab
    for r in records:
        ids = list(r["prompt_token_ids"])
        for _ in r["response_token_ids"]:  # greedy over the draft vocabulary, one full forward a token
            ids.append(int(keep[drafter(torch.tensor([ids])).logits[0, -1, keep].argmax()]))
        assert r["response_token_ids"] == ids[len(r["prompt_token_ids"]):]
        logits = target.model(torch.tensor([r["prompt_token_ids"] + r["response_token_ids"]])).logits[0]
        rows = logits[len(r["prompt_token_ids"]) - 1 : -1].float()  # (R, V)
        assert [row[0] for row in r["top_ids"]] == rows.argmax(-1).tolist()
        assert len(r["top_ids"]) == len(r["response_token_ids"]) and all(len(row) == 8 for row in r["top_ids"])
