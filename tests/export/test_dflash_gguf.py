"""The DFlash GGUF export (``--format dflash-gguf``): llama.cpp's ``dflash`` architecture with every key and tensor
its loader reads (names and shapes of src/models/dflash.cpp), ``target_layers`` as layer inputs (ids + 1), the
target GGUF's tokenizer plus the mask token id, ``token_embd`` = the target's table with the trained mask row,
``output`` = the target's head or the heads' own with ``d2t``; bad input refused with one line. (tests/engines/
runs the export in llama-server.)"""

import json

import numpy as np
import pytest
import torch
from gguf import GGUFReader, quants
from safetensors.torch import load_file

from dflash_toys import dflash_spec, dflash_weights, write_dflash_heads
from specdraft.cli import main
from specdraft.models.gguf_files import tokenizer_fields
from toys import save_tiny_checkpoint, tiny_llama, tiny_tokenizer, write_target_gguf

LAYERS = (0, 2, 3)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash_gguf")
    config = tiny_llama(0, layers=4).config
    save_tiny_checkpoint(root / "target", seed=0, layers=4)
    save_tiny_checkpoint(root / "shallow", seed=0, layers=2)
    write_dflash_heads(root / "full", dflash_spec(config, 2, 8, LAYERS, mask_token_id=5), str(root / "target"))
    write_dflash_heads(root / "draft", dflash_spec(config, 1, 4, LAYERS, draft_vocab_size=40), str(root / "target"))
    tokens = tiny_tokenizer().convert_ids_to_tokens(list(range(64)))
    write_target_gguf(root / "target.gguf", tokens)
    write_target_gguf(root / "short.gguf", tokens[:60])
    return root


def _export(root, heads, out, *extra, target="target", target_gguf="target.gguf"):
    return main(["export", str(root / heads), "--format", "dflash-gguf", "--out", str(out), "--target",
                 str(root / target), "--target-gguf", str(root / target_gguf), *extra])


def _values(tensor) -> np.ndarray:
    data = np.asarray(tensor.data)
    if tensor.tensor_type.name in ("F32", "I64"):
        return data
    return quants.dequantize(data, tensor.tensor_type)


def _bf16(t: torch.Tensor) -> np.ndarray:
    return t.float().bfloat16().float().numpy()


def test_the_gguf_has_llama_cpps_dflash_layout(root, tmp_path):
    assert _export(root, "full", tmp_path / "f.gguf", "--gguf-type", "bf16") == 0
    reader = GGUFReader(tmp_path / "f.gguf")
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields["general.architecture"] == "dflash" and fields["dflash.block_count"] == 2
    assert fields["dflash.target_layers"] == [1, 3, 4] and fields["dflash.block_size"] == 8  # layer inputs
    assert (fields["dflash.embedding_length"], fields["dflash.feed_forward_length"]) == (32, 64)
    assert (fields["dflash.attention.head_count"], fields["dflash.attention.head_count_kv"]) == (4, 2)
    assert fields["dflash.attention.key_length"] == fields["dflash.rope.dimension_count"] == 8
    assert fields["dflash.context_length"] == 256 and fields["dflash.rope.freq_base"] == pytest.approx(10000.0)
    assert "dflash.attention.causal" not in fields  # llama.cpp's default for DFlash: a non-causal block
    assert {k: v[0] for k, v in tokenizer_fields(tmp_path / "f.gguf").items()} == \
        {k: v[0] for k, v in tokenizer_fields(root / "target.gguf").items()} | {"tokenizer.ggml.mask_token_id": 5}
    tensors = {t.name: t for t in reader.tensors}
    per_layer = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_norm",
                 "ffn_gate", "ffn_up", "ffn_down")
    assert set(tensors) == {"token_embd.weight", "output.weight", "fc.weight", "enc.output_norm.weight",
                            "output_norm.weight"} | {f"blk.{i}.{n}.weight" for i in range(2) for n in per_layer}
    shapes = {name: t.shape.tolist() for name, t in tensors.items()}  # GGUF order: (in, out)
    assert shapes["fc.weight"] == [96, 32] and shapes["token_embd.weight"] == shapes["output.weight"] == [32, 64]
    assert shapes["blk.1.attn_q.weight"] == [32, 32] and shapes["blk.1.attn_k.weight"] == [32, 16]
    assert shapes["blk.0.attn_output.weight"] == [32, 32] and shapes["blk.0.attn_k_norm.weight"] == [8]
    assert shapes["blk.0.ffn_down.weight"] == [64, 32]
    heads = load_file(str(root / "full" / "heads.safetensors"))
    target = tiny_llama(0, layers=4)
    table = _values(tensors["token_embd.weight"]).reshape(64, 32)
    embed = target.model.embed_tokens.weight.detach()
    assert np.array_equal(table[5], _bf16(heads["mask_embedding"]))  # the trained mask vector
    assert np.array_equal(np.delete(table, 5, axis=0), np.delete(_bf16(embed), 5, axis=0))
    assert np.array_equal(_values(tensors["output.weight"]).reshape(64, 32), _bf16(target.lm_head.weight.detach()))
    q = heads["layers.1.self_attn.q_proj.weight"]  # NeoX rotary layout: rows as they are
    assert np.array_equal(_values(tensors["blk.1.attn_q.weight"]).reshape(32, 32), _bf16(q))
    assert np.array_equal(_values(tensors["enc.output_norm.weight"]), heads["hidden_norm.weight"].numpy())


def test_a_draft_vocabulary_writes_its_head_and_d2t_and_the_default_types(root, tmp_path):
    assert _export(root, "draft", tmp_path / "d.gguf") == 0
    tensors = {t.name: t for t in GGUFReader(tmp_path / "d.gguf").tensors}
    heads = load_file(str(root / "draft" / "heads.safetensors"))
    assert tensors["output.weight"].shape.tolist() == [32, 40] and tensors["d2t"].tensor_type.name == "I64"
    assert np.array_equal(np.asarray(tensors["d2t"].data), heads["d2t"].numpy())  # absolute target ids
    types = {name: t.tensor_type.name for name, t in tensors.items()}
    assert types["output.weight"] == types["token_embd.weight"] == types["fc.weight"] == "Q8_0"
    assert types["blk.0.ffn_up.weight"] == "Q8_0" and types["blk.0.attn_q_norm.weight"] == "F32"
    assert _export(root, "draft", tmp_path / "q.gguf", "--gguf-type", "q4_0", "--gguf-output-type", "q8_0") == 0
    types = {t.name: t.tensor_type.name for t in GGUFReader(tmp_path / "q.gguf").tensors}
    assert types["blk.0.attn_v.weight"] == types["fc.weight"] == "Q4_0" and types["output.weight"] == "Q8_0"


def test_q8_0_copies_a_q8_0_table_exactly():
    """The target's table read from a q8_0 GGUF survives the q8_0 export unchanged (same blocks, same scales)."""
    from gguf import GGMLQuantizationType as Q

    table = np.random.default_rng(0).normal(size=(16, 64)).astype(np.float32)
    once = quants.dequantize(quants.quantize(table, Q.Q8_0), Q.Q8_0)
    assert np.array_equal(quants.dequantize(quants.quantize(once, Q.Q8_0), Q.Q8_0), once)


def _edit(root, tmp_path, name, change):
    """A copy of heads ``name`` with heads.json's contents passed through ``change``."""
    import shutil

    folder = tmp_path / name
    shutil.copytree(root / name, folder)
    meta = json.loads((folder / "heads.json").read_text())
    change(meta)
    (folder / "heads.json").write_text(json.dumps(meta))
    return folder


@pytest.mark.parametrize(("case", "message"), [
    ("kind", "exports DFlash heads (kind dflash)"),
    ("layers", "does not fit target"),
    ("vocabulary", "vocabulary mismatch"),
    ("weights", "does not match its dflash spec"),
    ("spec", "the dflash spec lacks block_size"),
])
def test_bad_input_is_refused_in_one_line(root, tmp_path, capsys, case, message):
    heads, target, target_gguf = "full", "target", "target.gguf"
    if case == "kind":
        heads = _edit(root, tmp_path, "full", lambda m: m.update(kind="eagle3"))
    elif case == "layers":
        target = "shallow"  # 2 layers; the heads read layer 3
    elif case == "vocabulary":
        target_gguf = "short.gguf"
    elif case == "weights":
        heads = tmp_path / "w"
        spec = json.loads((root / "full" / "heads.json").read_text())["spec"]
        weights = dflash_weights(spec)
        del weights["layers.1.mlp.up_proj.weight"]
        write_dflash_heads(heads, spec, "target", weights=weights)
    elif case == "spec":
        heads = _edit(root, tmp_path, "full", lambda m: m["spec"].pop("block_size"))
    out = tmp_path / "x.gguf"
    code = _export(root, heads, out, target=target, target_gguf=target_gguf)
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.startswith("specdraft: error: ") and err.count("\n") == 1, err
    assert not out.exists()
