"""``specdraft export`` on tiny random Llamas: the hf folder loads alone in transformers with no warning and drafts
losslessly as ``assistant_model``; the GGUF carries the target GGUF's tokenizer metadata and the same weights;
the speculators config passes the schema; every format refuses an incompatible drafter and never leaves a
half-written export."""

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdraft.cli import main
from specdraft.errors import SpecdraftError
from specdraft.export import FORMATS, ExportConfig, export
from specdraft.export.speculators import check_config
from specdraft.models.shared_embeddings import EMBEDDING_KEY, drop_embeddings, write_shared_embeddings
from toys import save_tiny_checkpoint, tiny_llama, tiny_tokenizer, write_target_gguf


def _shared_drafter(path, target_path, seed=1):
    """A 1-layer drafter that shares the target's embedding table (saved without it)."""
    target = AutoModelForCausalLM.from_pretrained(target_path)
    drafter = tiny_llama(seed, layers=1)
    with torch.no_grad():
        drafter.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight)
    drafter.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    drop_embeddings(path / "model.safetensors")
    write_shared_embeddings(path, str(target_path), target.get_input_embeddings().weight)
    (path / "drafter_options.json").write_text(json.dumps({"confidence_threshold": 0.3}))
    return path


@pytest.fixture(scope="module")
def toys(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    target = save_tiny_checkpoint(root / "target", seed=0)
    tokens = tiny_tokenizer().convert_ids_to_tokens(list(range(64)))
    return {
        "root": root,
        "target": target,
        "shared": _shared_drafter(root / "shared", target),
        "own": save_tiny_checkpoint(root / "own", seed=2, layers=1),
        "other_vocab": save_tiny_checkpoint(root / "other_vocab", seed=3, vocab_size=80),
        "gguf": write_target_gguf(root / "target.gguf", tokens),
        "gguf_other": write_target_gguf(root / "other.gguf", [*tokens[:10], "zz", *tokens[11:]]),
    }


def _export(toys, drafter, fmt, out, **kwargs):
    return export(ExportConfig(str(toys[drafter]), fmt, str(out), target=str(toys["target"]), **kwargs))


def _load_quietly(folder, capfd):
    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    captured = capfd.readouterr()
    assert not any(info.values()), info  # missing / unexpected / mismatched keys
    for word in ("MISSING", "corrupt", "newly initialized", "UNEXPECTED"):
        assert word not in captured.err + captured.out
    return model.eval()


def test_formats_are_registered():
    assert {"hf", "gguf", "speculators"} <= set(FORMATS)
    with pytest.raises(SpecdraftError, match="unknown export format"):
        ExportConfig("d", "onnx", "out")


def test_hf_export_loads_alone_with_the_targets_table_and_assists_losslessly(toys, tmp_path, capfd):
    from specdraft.api import load_draft_model
    from specdraft.models.registry import load_model, load_tokenizer

    out = _export(toys, "shared", "hf", tmp_path / "hf")
    assert not (out / "shared_embeddings.json").exists() and (out / "drafter_options.json").is_file()
    assert "drafter_options.json" in (out / "README.md").read_text()
    model = _load_quietly(out, capfd)
    target_hf = AutoModelForCausalLM.from_pretrained(toys["target"]).eval()
    torch.testing.assert_close(model.get_input_embeddings().weight, target_hf.get_input_embeddings().weight)
    target, tokenizer = load_model(str(toys["target"])), load_tokenizer(str(toys["target"]))
    shared = load_draft_model(target, tokenizer, str(toys["shared"]))
    ids = torch.tensor([[1, 5, 9, 4, 7]])  # (1, 5)
    torch.testing.assert_close(model(ids).logits[0, -1], shared(ids, shared.new_cache(8))[0, -1], rtol=1e-4,
                               atol=1e-4)
    model.generation_config.num_assistant_tokens = 3
    model.generation_config.num_assistant_tokens_schedule = "constant"
    for prompt in ([1, 5, 9], [1, 30, 31, 32, 12], [1, 7]):
        x = torch.tensor([prompt])
        plain = target_hf.generate(x, max_new_tokens=20, do_sample=False, pad_token_id=0)
        assisted = target_hf.generate(x, max_new_tokens=20, do_sample=False, pad_token_id=0, assistant_model=model)
        assert torch.equal(plain, assisted)


def test_hf_export_with_a_token_ranking_names_model_safetensors_as_its_only_weights(toys, tmp_path, capfd):
    """vLLM loads every *.safetensors of a folder without an index: the index keeps the ranking out of its weights,
    while transformers and specdraft's draft_vocab still read theirs."""
    from specdraft.draft_vocab import RANKING_FILE, load_token_ranking, save_token_ranking

    drafter = tmp_path / "ranked"
    drafter.mkdir()
    for path in toys["shared"].iterdir():
        (drafter / path.name).write_bytes(path.read_bytes())
    ranking = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    save_token_ranking(drafter, ranking)
    out = export(ExportConfig(str(drafter), "hf", str(tmp_path / "hf"), target=str(toys["target"])))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert set(index["weight_map"]) == set(f.keys())
    assert (out / RANKING_FILE).is_file() and torch.equal(load_token_ranking(out, 64), ranking)
    _load_quietly(out, capfd)
    plain = _export(toys, "own", "hf", tmp_path / "plain")  # nothing beside the weights: no index
    assert not (plain / "model.safetensors.index.json").exists()


def test_every_format_refuses_an_incompatible_drafter(toys, tmp_path):
    for fmt in ("hf", "gguf", "speculators"):
        with pytest.raises(SpecdraftError, match="vocabulary mismatch"):
            _export(toys, "other_vocab", fmt, tmp_path / fmt, target_gguf=str(toys["gguf"]))
        assert not (tmp_path / fmt).exists()
    other = save_tiny_checkpoint(tmp_path / "other_target", seed=9)  # same tokenizer, other embeddings
    with pytest.raises(SpecdraftError, match="fingerprint"):
        export(ExportConfig(str(toys["shared"]), "hf", str(tmp_path / "x"), target=str(other)))


def test_an_existing_export_is_kept_until_the_new_one_is_complete(toys, tmp_path, monkeypatch):
    out = _export(toys, "own", "hf", tmp_path / "hf")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(SpecdraftError, match="exists; pass --overwrite"):
        _export(toys, "own", "hf", out)

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        _export(toys, "shared", "hf", out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary folder left beside it
    monkeypatch.undo()
    _export(toys, "shared", "hf", out, overwrite=True)
    assert (out / "drafter_options.json").is_file()


def _tokenizer_fields(path):
    from specdraft.models.gguf_files import tokenizer_fields

    return {k: v[0] for k, v in tokenizer_fields(path).items()}


@pytest.mark.parametrize(("gguf_type", "output_type"), [("bf16", None), ("q8_0", None), ("q4_0", None),
                                                        ("q8_0", "q4_0")])
def test_gguf_export_has_the_targets_tokenizer_metadata_and_the_drafters_weights(toys, tmp_path, gguf_type,
                                                                                 output_type):
    import gguf
    from gguf import GGUFReader

    out = _export(toys, "shared", "gguf", tmp_path / "d.gguf", target_gguf=str(toys["gguf"]), gguf_type=gguf_type,
                  gguf_output_type=output_type)
    assert _tokenizer_fields(out) == _tokenizer_fields(toys["gguf"])
    types = {t.name: t.tensor_type.name for t in GGUFReader(out).tensors}
    assert types["blk.0.attn_q.weight"] == gguf_type.upper() and types["output_norm.weight"] == "F32"
    assert "output.weight" in types  # the toy's head is untied
    heads = (output_type or gguf_type).upper()
    assert types["output.weight"] == types["token_embd.weight"] == heads
    gguf_model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="d.gguf", dtype=torch.float32).eval()
    hf = AutoModelForCausalLM.from_pretrained(_export(toys, "shared", "hf", tmp_path / "hf")).eval()
    ids = torch.tensor([[1, 5, 9, 4, 7, 30]])
    with torch.no_grad():  # the same model once its matrices are rounded as the GGUF stores them
        for name, p in hf.named_parameters():
            if p.ndim == 2:
                big = name in ("lm_head.weight", "model.embed_tokens.weight")
                qtype = getattr(gguf.GGMLQuantizationType, heads if big else gguf_type.upper())
                rounded = gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), qtype), qtype)
                p.copy_(torch.from_numpy(rounded.reshape(p.shape)))
    torch.testing.assert_close(gguf_model(ids).logits, hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_gguf_export_refuses_a_tokenizer_mismatch_and_a_folder(toys, tmp_path):
    with pytest.raises(SpecdraftError, match="tokenizer mismatch: 1 token"):
        _export(toys, "shared", "gguf", tmp_path / "d.gguf", target_gguf=str(toys["gguf_other"]))
    with pytest.raises(SpecdraftError, match="no GGUF file for target"):
        _export(toys, "shared", "gguf", tmp_path / "d.gguf")
    with pytest.raises(SpecdraftError, match="is a folder"):
        _export(toys, "shared", "gguf", tmp_path, target_gguf=str(toys["gguf"]), overwrite=True)
    assert not (tmp_path / "d.gguf").exists()


def test_speculators_export_passes_the_schema_and_still_loads_in_transformers(toys, tmp_path, capfd):
    out = _export(toys, "shared", "speculators", tmp_path / "spec", num_draft_tokens=5)
    config = json.loads((out / "config.json").read_text())
    check_config(config)
    spec = config["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == 5
    assert spec["verifier"] == {"name_or_path": str(toys["target"]), "architectures": ["LlamaForCausalLM"]}
    _load_quietly(out, capfd)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("speculators_model_type"), "speculators_model_type"),
    (lambda c: c["speculators_config"].update(algorithm="eagle"), "algorithm"),
    (lambda c: c["speculators_config"].update(proposal_methods=[]), "non-empty"),
    (lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=0), "speculative_tokens"),
    (lambda c: c["speculators_config"].update(default_proposal_method="tree"), "default_proposal_method"),
    (lambda c: c["speculators_config"]["verifier"].update(architectures="Llama"), "architectures"),
])
def test_speculators_schema_check_names_the_bad_field(edit, message):
    from specdraft.export.speculators import ALGORITHM

    config = {"model_type": "llama", "speculators_model_type": ALGORITHM, "speculators_config": {
        "algorithm": ALGORITHM, "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4}],
        "verifier": {"name_or_path": "t", "architectures": ["LlamaForCausalLM"]}}}
    check_config(config)
    edit(config)
    with pytest.raises(SpecdraftError, match=message):
        check_config(config)


def test_cli_export_prints_one_line_and_exits_2_on_an_existing_out(toys, tmp_path, capsys):
    argv = ["export", str(toys["own"]), "--format", "hf", "--out", str(tmp_path / "e"), "--target", str(toys["target"])]
    assert main(argv) == 0 and "exported" in capsys.readouterr().out
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exists" in err[0]


def test_a_shipped_drafter_resolves_to_a_standalone_copy_made_once(toys, tmp_path):
    from specdraft.models.standalone import SOURCE_FILE, shipped_standalone

    resolved = []

    def resolve_target(name):
        resolved.append(name)
        return toys["target"]

    out = shipped_standalone("toy", toys["shared"], tmp_path / "toy", resolve_target)
    assert out == tmp_path / "toy" and resolved == [str(toys["target"])]
    stamp = (out / SOURCE_FILE).stat().st_mtime_ns
    assert shipped_standalone("toy", toys["shared"], out, resolve_target) == out and len(resolved) == 1
    assert (out / SOURCE_FILE).stat().st_mtime_ns == stamp
    from safetensors.torch import load_file

    table = AutoModelForCausalLM.from_pretrained(toys["target"]).get_input_embeddings().weight
    torch.testing.assert_close(load_file(out / "model.safetensors")[EMBEDDING_KEY], table)
    options = toys["shared"] / "drafter_options.json"
    old = options.stat().st_mtime_ns
    os.utime(options, ns=(old, old + 10**9))  # the shipped package changed: the copy is made again
    try:
        assert shipped_standalone("toy", toys["shared"], out, resolve_target) == out and len(resolved) == 2
    finally:
        os.utime(options, ns=(old, old))


def test_gguf_types_default_per_format_and_follow_what_is_given():
    config = ExportConfig("d", "gguf", "o.gguf")
    assert config.gguf_types(("q8_0", "q4_0")) == ("q8_0", "q4_0")
    assert ExportConfig("d", "gguf", "o.gguf", gguf_type="bf16").gguf_types(("q8_0", "q4_0")) == ("bf16", "bf16")
    assert ExportConfig("d", "gguf", "o.gguf", gguf_output_type="q8_0").gguf_types(("q8_0", "q4_0")) == \
        ("q8_0", "q8_0")
    with pytest.raises(SpecdraftError, match="gguf_output_type must be one of"):
        ExportConfig("d", "gguf", "o.gguf", gguf_output_type="q2_k")
