"""The EAGLE-3 GGUF export (``--format eagle3-gguf``): llama.cpp's ``eagle3`` architecture with every key and
tensor its loader reads, the target GGUF's tokenizer verbatim, Q and K rows in llama.cpp's rotary layout, ``d2t`` as
absolute target ids, and the matrix types asked for. (The same export with the shipped heads was compared byte for
byte with llama.cpp's own converter; tests/engines/ runs it in llama.cpp.)"""

import numpy as np
import pytest
import torch
from gguf import GGUFReader, quants

from specdraft.cli import main
from specdraft.export.eagle3 import eagle3_tensors
from specdraft.export.gguf import permute_rows
from specdraft.heads import load_heads, save_heads
from specdraft.heads.eagle import head_config
from specdraft.heads.eagle3 import build_eagle3
from specdraft.models.gguf_files import tokenizer_fields
from specdraft.training.heads.eagle3 import parse_settings
from toys import save_tiny_checkpoint, tiny_llama, tiny_tokenizer, write_target_gguf


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3_gguf")
    spec = head_config(tiny_llama(0, layers=4).config) | parse_settings({"draft_vocab": "40"}, 4, 64)
    torch.manual_seed(0)
    ids = torch.randperm(64)[:40]
    save_heads(build_eagle3(dict(spec), ids), "eagle3", spec, root / "heads", "tiny")
    save_tiny_checkpoint(root / "target", seed=0, layers=4)
    tokens = tiny_tokenizer().convert_ids_to_tokens(list(range(64)))
    write_target_gguf(root / "target.gguf", tokens)
    write_target_gguf(root / "short.gguf", tokens[:60])
    return root, ids


def _export(root, out, *extra):
    return main(["export", str(root / "heads"), "--format", "eagle3-gguf", "--out", str(out), "--target",
                 str(root / "target"), "--target-gguf", str(root / "target.gguf"), *extra])


def _values(tensor) -> np.ndarray:
    data = np.asarray(tensor.data)
    if tensor.tensor_type.name in ("F32", "I64"):
        return data
    return quants.dequantize(data, tensor.tensor_type)


def test_the_gguf_has_llama_cpps_eagle3_layout(heads, tmp_path):
    root, ids = heads
    assert _export(root, tmp_path / "e.gguf", "--gguf-type", "bf16") == 0
    reader = GGUFReader(tmp_path / "e.gguf")
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields["general.architecture"] == "eagle3" and fields["eagle3.block_count"] == 1
    assert fields["eagle3.target_layers"] == [0, 2, 3] and fields["eagle3.target_hidden_size"] == 32
    assert fields["eagle3.norm_before_residual"] is False and fields["eagle3.embedding_length"] == 32
    assert {k: v[0] for k, v in tokenizer_fields(tmp_path / "e.gguf").items()} == \
        {k: v[0] for k, v in tokenizer_fields(root / "target.gguf").items()}
    tensors = {t.name: t for t in reader.tensors}
    assert "token_embd.weight" not in tensors  # llama.cpp embeds with the target's table
    assert tensors["output.weight"].shape.tolist() == [32, 40] and tensors["fc.weight"].shape.tolist() == [96, 32]
    assert tensors["blk.0.attn_q.weight"].shape.tolist() == [64, 32]  # reads the 2D concatenation
    assert tensors["d2t"].tensor_type.name == "I64"
    assert np.array_equal(np.asarray(tensors["d2t"].data), ids.sort().values.numpy())  # absolute target ids
    _, head = load_heads(root / "heads", kind="eagle3")
    ours = eagle3_tensors(head, torch.float32)
    q = permute_rows(ours["midlayer.self_attn.q_proj.weight"], 4).bfloat16().float().numpy()
    k = permute_rows(ours["midlayer.self_attn.k_proj.weight"], 2).bfloat16().float().numpy()
    assert np.array_equal(_values(tensors["blk.0.attn_q.weight"]), q)
    assert np.array_equal(_values(tensors["blk.0.attn_k.weight"]), k)
    assert np.array_equal(_values(tensors["blk.0.attn_norm_2.weight"]), ours["midlayer.hidden_norm.weight"].numpy())


def test_matrix_types_and_a_harder_quantized_head(heads, tmp_path):
    root, _ = heads
    assert _export(root, tmp_path / "q.gguf", "--gguf-type", "q8_0", "--gguf-output-type", "q4_0") == 0
    types = {t.name: t.tensor_type.name for t in GGUFReader(tmp_path / "q.gguf").tensors}
    assert types["output.weight"] == "Q4_0"
    assert types["fc.weight"] == types["blk.0.ffn_down.weight"] == "Q8_0"
    assert types["output_norm.weight"] == "F32" and types["d2t"] == "I64"


def test_the_default_is_q4_0(heads, tmp_path):
    root, _ = heads
    assert _export(root, tmp_path / "d.gguf") == 0
    types = {t.name: t.tensor_type.name for t in GGUFReader(tmp_path / "d.gguf").tensors}
    assert types["output.weight"] == types["fc.weight"] == types["blk.0.attn_q.weight"] == "Q4_0"


def test_a_target_gguf_of_another_vocabulary_is_refused(heads, tmp_path, capsys):
    root, _ = heads
    code = main(["export", str(root / "heads"), "--format", "eagle3-gguf", "--out", str(tmp_path / "x.gguf"),
                 "--target", str(root / "target"), "--target-gguf", str(root / "short.gguf")])
    assert code == 2 and "vocabulary mismatch" in capsys.readouterr().err and not (tmp_path / "x.gguf").exists()
