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


@pytest.mark.slow  # converts the real target's GGUF
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


@pytest.mark.slow  # the real target
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
    assert set(options) == {"draft_vocab", "confidence_threshold", "prompt_lookup", "prompt_lookup_alone", "quantize",
                            "context_window", "ngram_table", "ngram_min_order"}
    assert (FOLDER / DRAFTER_OPTIONS_FILE).is_file()
    ranking = load_token_ranking(FOLDER, 49152)  # a permutation of the vocabulary, checked on load
    assert int(options["draft_vocab"]) < ranking.numel()


def test_shipped_ngram_table_loads_for_smollm2():
    from specdraft.drafters.ngram import load_table
    from specdraft.models.registry import SMOLLM2_NGRAM, default_ngram, resolve_ngram

    table = load_table(resolve_ngram(SMOLLM2_NGRAM))
    assert default_ngram(SMOLLM2) == SMOLLM2_NGRAM and table.max_order == 4
    assert table.manifest["entries"] == len(table.keys) > 100_000
    assert int(table.successors.max()) < 49152 and 0 < float(table.shares.min()) <= float(table.shares.max()) <= 1


def _assert_lossless_and_drafting(target, tokenizer, drafter) -> None:
    """fp32 greedy output with ``drafter`` equals plain decoding on every third built-in prompt, and some draft
    tokens are accepted."""
    from specdraft.api import encode_prompt, eos_token_ids
    from specdraft.decoding import generate
    from specdraft.prompts import BUILTIN_PROMPTS
    from specdraft.sequence import GenerationConfig

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


@pytest.mark.slow
def test_shipped_ngram_table_with_smollm2_is_lossless():
    from specdraft.api import load_drafter, load_target

    target, tokenizer = load_target(SMOLLM2, torch.float32)
    drafter = load_drafter(target, tokenizer, drafter="ngram")  # the tokenizer fingerprint is checked
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


def _smollm2_shaped_target(layers: int = 28) -> NativeLlama:
    """A random fp32 Llama of SmolLM2-135M's width, heads and vocabulary, deep enough for aux layers [2, 15, 27]
    (narrow MLPs keep it quick), named like the built-in."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=512, rope_theta=1e5,
                         rms_norm_eps=1e-5, tie_word_embeddings=True)
    target, generator = NativeLlama(config, name=SMOLLM2), torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in target.parameters():  # norms 1, matrices N(0, 0.05^2)
            parameter.copy_(torch.ones(parameter.shape) if parameter.dim() == 1
                            else torch.randn(parameter.shape, generator=generator) * 0.05)
    return target


def test_shipped_eagle3_head_is_small_bf16_with_exact_draft_vocabulary_and_card():
    from specdraft.drafters.options import folder_options
    from specdraft.heads import WEIGHTS_FILE, load_heads
    from specdraft.models.registry import SHIPPED_HEADS, SMOLLM2_EAGLE3, resolve_heads

    folder = resolve_heads(SMOLLM2_EAGLE3)
    assert folder == SHIPPED_HEADS[SMOLLM2_EAGLE3] and (folder / WEIGHTS_FILE).stat().st_size <= 40 * 2**20
    with safe_open(str(folder / WEIGHTS_FILE), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes.pop("d2t") == "I64" and dtypes.pop("t2d") == "BOOL" and set(dtypes.values()) == {"BF16"}
    meta, head = load_heads(SMOLLM2_EAGLE3, kind="eagle3")
    assert meta["target"] == SMOLLM2 and (meta["spec"]["vocab_size"], meta["spec"]["hidden_size"]) == (49152, 576)
    assert head.aux_layers == [2, 15, 27] and head.draft_token_ids.numel() == 8192
    ids = head.draft_token_ids
    assert bool((ids[1:] > ids[:-1]).all()) and int(ids[-1]) < 49152 and int(head.t2d.sum()) == 8192
    assert folder_options(folder) == {"top_k": "2", "tree_nodes": "4"}
    card = (folder / "README.md").read_text()
    assert "Budget" in card and "Measured results" in card and "<!-- results:begin -->" in card


def test_eagle3_without_heads_uses_the_shipped_head_for_smollm2_only(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from specdraft.drafters import load_drafter
    from specdraft.drafters.eagle3 import Eagle3Drafter
    from specdraft.errors import SpecdraftError
    from specdraft.models.registry import DEFAULT_HEADS, SMOLLM2_EAGLE3

    assert DEFAULT_HEADS[("eagle3", SMOLLM2)] == SMOLLM2_EAGLE3
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    for name in (SMOLLM2, str(tmp_path / SMOLLM2)):  # the built-in's name, or the folder it is converted to
        drafter = load_drafter(SimpleNamespace(name=name), None, drafter="eagle3")
        assert isinstance(drafter, Eagle3Drafter) and drafter.hidden_layers == (2, 15, 27)
        assert (drafter.top_k, drafter.tree_nodes) == (2, 4)  # the shipped drafter_options.json
    chain = load_drafter(SimpleNamespace(name=SMOLLM2), None, drafter="eagle3", options={"top_k": "1"})
    assert chain.top_k == 1
    with pytest.raises(SpecdraftError, match=r"no shipped eagle3 heads for target 'other-model'.*"
                                             r"smollm2-135m-instruct-eagle3 for smollm2-135m-instruct"):
        load_drafter(SimpleNamespace(name="other-model"), None, drafter="eagle3")


def test_shipped_eagle3_head_on_a_smollm2_shaped_target_keeps_greedy_output():
    """The shipped head through the whole drafting path (features of layers 2, 15, 27, bf16 weights cast to the
    target's fp32, d2t) on a random target of SmolLM2's shape: chain and tree output equal plain decoding."""
    from specdraft.decoding import generate
    from specdraft.drafters import load_drafter
    from specdraft.sequence import GenerationConfig

    target = _smollm2_shaped_target()
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 2, 198, 1, 520, 9531, 198]
    plain = generate(target, prompt, None, GenerationConfig(12)).token_ids
    for options in ({"top_k": "1"}, {}):
        drafter = load_drafter(target, None, drafter="eagle3", options=options)
        result = generate(target, prompt, drafter, GenerationConfig(12, 3, speculation="fixed"))  # cost-blind
        assert result.token_ids == plain and result.stats.draft_tokens_proposed > 0


def test_shipped_eagle3_head_exports_for_the_engines(tmp_path):
    from specdraft.export.eagle3 import export_eagle3
    from specdraft.heads import load_heads
    from specdraft.models.registry import SMOLLM2_EAGLE3

    out = export_eagle3(SMOLLM2_EAGLE3, tmp_path / "flat")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 8192
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27] and config["specdraft_target"] == SMOLLM2
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        d2t = f.get_tensor("d2t")
    assert torch.equal(d2t, load_heads(SMOLLM2_EAGLE3, kind="eagle3")[1].d2t)


@pytest.mark.slow
def test_shipped_eagle3_head_with_smollm2_is_lossless_and_drafts(tmp_path):
    """The real target in fp32, ``--drafter eagle3`` with no heads given (the shipped head, its default tree);
    then ``specdraft export --format eagle3`` by name, checked against the target."""
    from specdraft.api import load_drafter, load_target
    from specdraft.cli import main
    from specdraft.models.registry import SMOLLM2_EAGLE3

    target, tokenizer = load_target(SMOLLM2, torch.float32)
    drafter = load_drafter(target, tokenizer, drafter="eagle3")
    assert drafter.hidden_layers == (2, 15, 27) and (drafter.top_k, drafter.tree_nodes) == (2, 4)
    _assert_lossless_and_drafting(target, tokenizer, drafter)
    assert main(["export", SMOLLM2_EAGLE3, "--format", "eagle3", "--out", str(tmp_path / "flat")]) == 0
    assert (tmp_path / "flat" / "model.safetensors").is_file()


def test_shipped_dflash_head_is_small_bf16_with_its_card_and_is_the_default(tmp_path, monkeypatch):
    """``smollm2-135m-instruct-dflash``: bf16 weights under 20 MiB with an exact int64 ``d2t``, the spec the
    llama.cpp export reads, a card with its budget, and ``--drafter dflash``'s default for SmolLM2 only."""
    from types import SimpleNamespace

    from specdraft.drafters import load_drafter
    from specdraft.drafters.dflash import DFlashDrafter
    from specdraft.errors import SpecdraftError
    from specdraft.heads import WEIGHTS_FILE, load_heads
    from specdraft.models.registry import DEFAULT_HEADS, SMOLLM2_DFLASH, resolve_heads

    folder = resolve_heads(SMOLLM2_DFLASH)
    assert DEFAULT_HEADS[("dflash", SMOLLM2)] == SMOLLM2_DFLASH
    assert (folder / WEIGHTS_FILE).stat().st_size <= 20 * 2**20
    with safe_open(str(folder / WEIGHTS_FILE), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes.pop("d2t") == "I64" and set(dtypes.values()) == {"BF16"} and "mask_embedding" in dtypes
    meta, head = load_heads(SMOLLM2_DFLASH, kind="dflash")
    assert meta["target"] == SMOLLM2 and meta["spec"]["target_layer_ids"] == [1, 8, 14, 20, 27]
    spec = meta["spec"]
    assert (spec["block_size"], spec["mask_token_id"], spec["draft_vocab_size"]) == (8, 16, 8192)
    ids = head.d2t
    assert bool((ids[1:] > ids[:-1]).all()) and int(ids[-1]) < 49152
    card = (folder / "README.md").read_text()
    assert "Budget" in card and "train-heads --kind dflash" in card
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    drafter = load_drafter(SimpleNamespace(name=SMOLLM2), None, drafter="dflash", options={"quantize": "none"})
    assert isinstance(drafter, DFlashDrafter) and drafter.hidden_layers == (2, 9, 15, 21, 28)
    with pytest.raises(SpecdraftError, match="no shipped dflash heads for target 'other-model'"):
        load_drafter(SimpleNamespace(name="other-model"), None, drafter="dflash")
