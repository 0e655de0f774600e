"""The CLI contract: JSON lines, --n, and one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest

from specdraft.cli import main
from toys import WORDS, save_tiny_checkpoint, tiny_tokenizer


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "target": str(save_tiny_checkpoint(root / "target", seed=0)),
        "draft": str(save_tiny_checkpoint(root / "draft", seed=1, layers=1)),
        "other_vocab": str(save_tiny_checkpoint(root / "other_vocab", seed=2, vocab_size=80)),
        "other_tok": str(save_tiny_checkpoint(root / "other_tok", seed=3, tokenizer=tiny_tokenizer(WORDS[::-1]))),
    }


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _records(out):
    return [json.loads(line) for line in out.strip().splitlines()]


def test_generate_json_plain_and_speculative_agree(ckpts, capsys):
    base = ["generate", "--target", ckpts["target"], "--prompt", "w1 w2 w3 w1 w2", "--max-new-tokens", "12", "--json"]
    code, out, _ = _run(capsys, *base)
    assert code == 0
    (plain,) = _records(out)
    assert set(plain) >= {"token_ids", "text", "stats"}
    assert set(plain["stats"]) >= {"new_tokens", "target_forward_calls", "block_efficiency", "acceptance_rate",
                                   "decode_seconds", "tokens_per_second"}
    assert plain["stats"]["block_efficiency"] == 1.0
    tree = ["--draft", ckpts["draft"], "--drafter-option", "tree_branching=2", "--drafter-option", "tree_nodes=5"]
    for extra in (["--draft", ckpts["draft"]], ["--drafter", "prompt-lookup"], tree):
        code, out, _ = _run(capsys, *base, *extra, "--num-draft-tokens", "3")
        assert code == 0
        (spec,) = _records(out)
        assert spec["token_ids"] == plain["token_ids"]
        assert spec["text"] == plain["text"]


def test_n_completions_with_derived_seeds(ckpts, capsys):
    argv = ["generate", "--target", ckpts["target"], "--draft", ckpts["draft"], "--prompt-ids", "3,4,5",
            "--temperature", "1.0", "--top-p", "0.9", "--max-new-tokens", "8", "--n", "3", "--seed", "5", "--json",
            "--speculation", "fixed"]  # adaptive draft lengths follow timings: exact in distribution, not replayable
    code, out, _ = _run(capsys, *argv)
    assert code == 0
    first = _records(out)
    assert len(first) == 3
    assert len({tuple(r["token_ids"]) for r in first}) > 1  # independent draws
    _, out, _ = _run(capsys, *argv)
    again = _records(out)
    assert [r["token_ids"] for r in again] == [r["token_ids"] for r in first]  # same seed, same completions


def test_chat_prompt_uses_template(ckpts, capsys):
    code, out, _ = _run(capsys, "generate", "--target", ckpts["target"], "--prompt", "w5 w6", "--chat",
                        "--max-new-tokens", "4", "--json")
    assert code == 0 and len(_records(out)[0]["token_ids"]) <= 4


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompt", "   "], "empty prompt"),
        (["--prompt-ids", "1,2", "--max-new-tokens", "400"], "prompt too long"),
        (["--prompt-ids", "1,2", "--temperature", "-1"], "temperature"),
        (["--prompt-ids", "1,2", "--temperature", "nan"], "temperature"),
        (["--prompt-ids", "1,2", "--top-p", "0"], "top_p"),
        (["--prompt-ids", "1,2", "--top-p", "1.5"], "top_p"),
        (["--prompt-ids", "1,2", "--top-k", "-3"], "top_k"),
        (["--prompt-ids", "1,2", "--num-draft-tokens", "0"], "num_draft_tokens"),
        (["--prompt-ids", "1,2", "--draft", "no/such-model-xyz"], "no/such-model-xyz"),
        (["--prompt-ids", "1,2", "--draft", "/nonexistent/folder"], "unknown model"),
        (["--prompt-ids", "1,2", "--drafter-option", "tree_nodes=4"], "drafter options need a drafter"),
        (["--prompt-ids", "1,2", "--drafter", "prompt-lookup", "--drafter-option", "x"], "must be KEY=VALUE"),
    ],
)
def test_bad_input_exits_2_with_one_line(ckpts, capsys, extra, message):
    code, _, err = _run(capsys, "generate", "--target", ckpts["target"], *extra)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_vocab_and_tokenizer_mismatch(ckpts, capsys):
    code, _, err = _run(capsys, "generate", "--target", ckpts["target"], "--draft", ckpts["other_vocab"],
                        "--prompt-ids", "1,2")
    assert code == 2 and "vocabulary mismatch" in err and "64" in err and "80" in err
    code, _, err = _run(capsys, "generate", "--target", ckpts["target"], "--draft", ckpts["other_tok"],
                        "--prompt-ids", "1,2")
    assert code == 2 and "tokenizer mismatch" in err


def test_corrupt_checkpoint(ckpts, tmp_path, capsys):
    bad = tmp_path / "bad"
    save_tiny_checkpoint(bad, seed=4)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    code, _, err = _run(capsys, "generate", "--target", ckpts["target"], "--draft", str(bad), "--prompt-ids", "1")
    assert code == 2 and "checkpoint" in err and str(bad) in err


def test_truncated_weights_under_either_backend_and_a_prompt_of_bytes_that_are_not_utf8(ckpts, tmp_path, capsys):
    bad = tmp_path / "bad"
    save_tiny_checkpoint(bad, seed=4)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 3])
    capsys.readouterr()
    for backend in ("native", "hf"):
        code, _, err = _run(capsys, "generate", "--target", ckpts["target"], "--draft", str(bad), "--backend", backend,
                            "--prompt-ids", "1")
        errors = [line for line in err.splitlines() if line.startswith("specdraft: error:")]  # after progress bars
        assert code == 2 and len(errors) == 1 and str(bad) in errors[0] and "Traceback" not in err, err
    prompt = b"w1 caf\xe9".decode("utf-8", "surrogateescape")  # what Python makes of such bytes in argv
    code, _, err = _run(capsys, "generate", "--target", ckpts["target"], "--prompt", prompt)
    assert code == 2 and "the prompt is not UTF-8 text (character 7" in err, err


def test_console_script_error_has_no_traceback(ckpts):
    proc = subprocess.run([sys.executable, "-m", "specdraft.cli", "generate", "--target", ckpts["target"],
                           "--prompt-ids", "1,2", "--top-p", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "specdraft: error: top_p must be in (0, 1], got 2.0"


def test_serve_online_distill_flags_build_its_config(ckpts, capsys, monkeypatch, tmp_path):
    import specdraft.serve

    served = []
    monkeypatch.setattr(specdraft.serve, "run_server", served.append)
    code, _, _ = _run(capsys, "serve", "--target", ckpts["target"], "--draft", ckpts["draft"], "--online-distill",
                      str(tmp_path), "--online-loss", "tvdpp", "--online-every-tokens", "100", "--online-nice", "0")
    online = served[0].online_distill
    assert code == 0 and (online.folder, online.loss, online.every_tokens, online.nice) == (str(tmp_path), "tvdpp",
                                                                                           100, 0)
    code, _, err = _run(capsys, "serve", "--target", ckpts["target"], "--drafter", "prompt-lookup",
                        "--online-distill", str(tmp_path))
    assert code == 2 and "--draft" in err and len(err.strip().splitlines()) == 1
