"""The drafters shipped in the package (``smollm2-135m-instruct-drafter`` and the EAGLE heads
``smollm2-135m-instruct-eagle``): present, small, bf16, loadable, with their measured default options; with the
real target (slow) they pass the compatibility checks and keep fp32 greedy output identical."""

import json

import pytest
import torch
from safetensors import safe_open

from specdraft.models.native_llama import NativeLlama
from specdraft.models.registry import DEFAULT_DRAFTERS, SHIPPED, SMOLLM2, SMOLLM2_DRAFTER, resolve

FOLDER = SHIPPED[SMOLLM2_DRAFTER]


def test_shipped_drafter_is_a_small_bf16_llama_with_a_model_card():
    assert DEFAULT_DRAFTERS[SMOLLM2] == SMOLLM2_DRAFTER
    weights = FOLDER / "model.safetensors"
    assert weights.stat().st_size <= 40 * 2**20
    with safe_open(str(weights), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    config = json.loads((FOLDER / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152 and config["num_hidden_layers"] <= 4
    card = (FOLDER / "README.md").read_text()
    assert "Budget" in card and "Measured" in card


def test_shipped_drafter_resolves_to_a_standalone_copy_with_the_targets_table():
    """The package ships the drafter without the embedding table; its name resolves to a copy in the cache folder
    that holds the table, so that transformers loads it on its own."""
    from specdraft.models.shared_embeddings import EMBEDDING_KEY, shared_embeddings
    from specdraft.models.standalone import checkpoint_table

    folder = resolve(SMOLLM2_DRAFTER)
    assert shared_embeddings(folder) is None and folder != FOLDER
    table = checkpoint_table(folder)
    assert table.dtype == torch.bfloat16 and list(table.shape) == [49152, 576]
    torch.testing.assert_close(table, checkpoint_table(resolve(SMOLLM2)).bfloat16())
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert EMBEDDING_KEY in f.keys()
    assert (folder / "drafter_options.json").read_bytes() == (FOLDER / "drafter_options.json").read_bytes()


def test_shipped_drafter_loads_with_its_target():
    """Through ``--draft`` (the compatibility checks, and the target's embedding table when the drafter shares
    it), in bf16; its own file holds everything else."""
    from specdraft.api import load_draft_model, load_target
    from specdraft.models.shared_embeddings import shared_embeddings

    target, tokenizer = load_target(SMOLLM2, torch.bfloat16)
    model = load_draft_model(target, tokenizer, SMOLLM2_DRAFTER, torch.bfloat16)
    assert isinstance(model, NativeLlama) and model.vocab_size == 49152
    record = shared_embeddings(FOLDER)
    if record is not None:
        assert record["target"] == SMOLLM2 and record["shape"] == list(target.embed_weight.shape)
        assert torch.equal(model.embed_weight, target.embed_weight)


def test_shipped_drafter_ships_its_measured_options_and_token_ranking():
    from specdraft.draft_vocab import load_token_ranking
    from specdraft.drafters.options import DRAFTER_OPTIONS_FILE, folder_options

    options = folder_options(FOLDER)
    assert set(options) == {"draft_vocab", "confidence_threshold", "prompt_lookup", "prompt_lookup_alone"}
    assert (FOLDER / DRAFTER_OPTIONS_FILE).is_file()
    ranking = load_token_ranking(FOLDER, 49152)  # a permutation of the vocabulary, checked on load
    assert int(options["draft_vocab"]) < ranking.numel()


def _assert_lossless_and_drafting(target, tokenizer, drafter) -> None:
    """fp32 greedy output with ``drafter`` equals plain decoding on every third built-in prompt, and some draft
    tokens are accepted."""
    from specdraft.api import encode_prompt, eos_token_ids
    from specdraft.decoding import GenerationConfig, generate
    from specdraft.prompts import BUILTIN_PROMPTS

    config = GenerationConfig(48, 4, eos_token_ids=eos_token_ids(tokenizer, SMOLLM2))
    accepted = 0
    for prompt in BUILTIN_PROMPTS[::3]:
        ids = encode_prompt(tokenizer, prompt.text, chat=True)
        result = generate(target, ids, drafter, config)
        assert result.token_ids == generate(target, ids, None, config).token_ids, prompt.category
        accepted += result.stats.draft_tokens_accepted
    assert accepted > 0


@pytest.mark.slow
def test_shipped_drafter_with_smollm2_is_compatible_and_lossless():
    from specdraft.api import load_drafter, load_target

    target, tokenizer = load_target(SMOLLM2, torch.float32)
    drafter = load_drafter(target, tokenizer, draft=SMOLLM2_DRAFTER)  # runs the compatibility check
    _assert_lossless_and_drafting(target, tokenizer, drafter)


def test_shipped_eagle_heads_are_small_bf16_with_options_and_ranking():
    from specdraft.draft_vocab import load_token_ranking
    from specdraft.drafters.options import folder_options
    from specdraft.heads import WEIGHTS_FILE, load_heads
    from specdraft.models.registry import SHIPPED_HEADS, SMOLLM2_EAGLE, resolve_heads

    folder = resolve_heads(SMOLLM2_EAGLE)
    assert folder == SHIPPED_HEADS[SMOLLM2_EAGLE] and (folder / WEIGHTS_FILE).stat().st_size <= 16 * 2**20
    with safe_open(str(folder / WEIGHTS_FILE), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    meta, _ = load_heads(SMOLLM2_EAGLE, kind="eagle")
    assert meta["spec"]["vocab_size"] == 49152 and meta["spec"]["hidden_size"] == 576
    assert folder_options(folder) == {"top_k": "2", "tree_nodes": "4", "draft_vocab": "8192"}
    assert load_token_ranking(folder, 49152).numel() == 49152
    assert "Measured results" in (folder / "README.md").read_text()


@pytest.mark.slow
def test_shipped_eagle_heads_with_smollm2_are_lossless_and_draft():
    from specdraft.api import load_drafter, load_target
    from specdraft.models.registry import SMOLLM2_EAGLE

    target, tokenizer = load_target(SMOLLM2, torch.float32)
    drafter = load_drafter(target, tokenizer, drafter="eagle", options={"heads": SMOLLM2_EAGLE})
    assert (drafter.top_k, drafter.tree_nodes, drafter.keep.numel()) == (2, 4, 8192)  # the shipped defaults
    _assert_lossless_and_drafting(target, tokenizer, drafter)


@pytest.mark.slow
def test_shipped_drafter_loads_alone_in_transformers_and_assists_losslessly(capfd):
    """``AutoModelForCausalLM.from_pretrained`` on the folder the name resolves to: no missing or unexpected weight,
    no warning; as transformers' ``assistant_model`` (γ 4, fp32) the output equals plain greedy ``generate`` on
    held-out ShareGPT prompts."""
    from transformers import AutoModelForCausalLM

    from specdraft.api import encode_prompt
    from specdraft.bench.questions import SHAREGPT_HELDOUT, load_questions
    from specdraft.models.registry import load_tokenizer

    assistant, info = AutoModelForCausalLM.from_pretrained(resolve(SMOLLM2_DRAFTER), dtype=torch.float32,
                                                           output_loading_info=True)
    captured = capfd.readouterr()
    assert not any(info.values()), info
    assert not any(word in captured.err for word in ("MISSING", "corrupt", "initialized", "UNEXPECTED"))
    target = AutoModelForCausalLM.from_pretrained(resolve(SMOLLM2), dtype=torch.float32)
    tokenizer = load_tokenizer(SMOLLM2)
    gc = assistant.generation_config
    gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = 4, "constant", 0.0
    for question in load_questions(SHAREGPT_HELDOUT)[:4]:
        ids = torch.tensor([encode_prompt(tokenizer, question.turns[0], chat=True)])  # (1, N)
        kwargs = {"max_new_tokens": 64, "do_sample": False, "pad_token_id": tokenizer.eos_token_id}
        plain = target.generate(ids, **kwargs)
        assert torch.equal(target.generate(ids, assistant_model=assistant, **kwargs), plain), question.question_id
