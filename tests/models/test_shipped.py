"""The drafter shipped in the package (``smollm2-135m-instruct-drafter``): present, small, bf16, loadable; with the
real target (slow) it passes the compatibility check and keeps fp32 greedy output identical."""

import json

import pytest
import torch
from safetensors import safe_open

from specdraft.models.native_llama import NativeLlama
from specdraft.models.registry import DEFAULT_DRAFTERS, SHIPPED, SMOLLM2, SMOLLM2_DRAFTER, resolve

FOLDER = SHIPPED[SMOLLM2_DRAFTER]


def test_shipped_drafter_is_a_small_bf16_llama_with_a_model_card():
    assert resolve(SMOLLM2_DRAFTER) == FOLDER and DEFAULT_DRAFTERS[SMOLLM2] == SMOLLM2_DRAFTER
    weights = FOLDER / "model.safetensors"
    assert weights.stat().st_size <= 40 * 2**20
    with safe_open(str(weights), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    config = json.loads((FOLDER / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152 and config["num_hidden_layers"] <= 4
    card = (FOLDER / "README.md").read_text()
    assert "Budget" in card and "Measured" in card
    model = NativeLlama.from_pretrained(FOLDER, torch.bfloat16)
    assert model.vocab_size == 49152


def test_shipped_drafter_ships_its_measured_options_and_token_ranking():
    from specdraft.api import DRAFTER_OPTIONS_FILE, _folder_options
    from specdraft.draft_vocab import load_token_ranking

    options = _folder_options(FOLDER)
    assert set(options) == {"draft_vocab", "confidence_threshold"} and (FOLDER / DRAFTER_OPTIONS_FILE).is_file()
    ranking = load_token_ranking(FOLDER, 49152)  # a permutation of the vocabulary, checked on load
    assert int(options["draft_vocab"]) < ranking.numel()


@pytest.mark.slow
def test_shipped_drafter_with_smollm2_is_compatible_and_lossless():
    from specdraft.api import encode_prompt, eos_token_ids, load_drafter, load_target
    from specdraft.decoding import GenerationConfig, generate
    from specdraft.prompts import BUILTIN_PROMPTS

    target, tokenizer = load_target(SMOLLM2, torch.float32)
    drafter = load_drafter(target, tokenizer, draft=SMOLLM2_DRAFTER)  # runs the compatibility check
    config = GenerationConfig(48, 4, eos_token_ids=eos_token_ids(tokenizer, SMOLLM2))
    accepted = 0
    for prompt in BUILTIN_PROMPTS[::3]:
        ids = encode_prompt(tokenizer, prompt.text, chat=True)
        result = generate(target, ids, drafter, config)
        assert result.token_ids == generate(target, ids, None, config).token_ids, prompt.category
        accepted += result.stats.draft_tokens_accepted
    assert accepted > 0
