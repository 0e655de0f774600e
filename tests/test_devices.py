"""Decoding on the device asked for: transformers models on CUDA behind the CPU-facing CausalLM interface give the
CPU's greedy text and block efficiency in float32 (run where CUDA is visible), and what only runs on the CPU is
refused by name."""

import json

import pytest
import torch

from specdraft.cli import main
from toys import save_tiny_checkpoint

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return str(save_tiny_checkpoint(root / "target", seed=0)), str(save_tiny_checkpoint(root / "draft", seed=1,
                                                                                           layers=1))


def _generate(capsys, target, *extra):
    code = main(["generate", "--target", target, "--prompt", "w1 w2 w3 w1 w2", "--max-new-tokens", "12", "--json",
                 "--speculation", "fixed", *extra])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else err)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_transformers_on_the_device_decode_as_on_the_cpu(ckpts, capsys, device):
    target, draft = ckpts
    _, reference = _generate(capsys, target, "--backend", "hf", "--device", "cpu")
    code, plain = _generate(capsys, target, "--backend", "hf", "--device", device)
    code_draft, drafted = _generate(capsys, target, "--draft", draft, "--backend", "hf", "--device", device)
    _, drafted_cpu = _generate(capsys, target, "--draft", draft, "--backend", "hf", "--device", "cpu")
    assert code == code_draft == 0
    assert plain["token_ids"] == drafted["token_ids"] == reference["token_ids"]
    assert drafted["stats"]["block_efficiency"] == pytest.approx(drafted_cpu["stats"]["block_efficiency"])


def test_what_runs_on_the_cpu_only_is_refused_on_another_device(ckpts, capsys):
    target, _ = ckpts
    code, err = _generate(capsys, target, "--device", "gpu")
    assert code == 2 and "device must be auto, cpu, cuda or cuda:N" in err
    code, err = _generate(capsys, target, "--device", "cuda", "--backend", "native")
    expected = "--backend native decodes on the CPU" if torch.cuda.is_available() else "no CUDA device is visible"
    assert code == 2 and expected in err
    if torch.cuda.is_available():
        code, err = _generate(capsys, target, "--device", "cuda", "--drafter", "eagle3")
        assert code == 2 and "use --device cpu" in err
