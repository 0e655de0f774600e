"""``--format gguf``: a llama.cpp draft model (``llama-server -md drafter.gguf``).

llama.cpp pairs a draft model with a target only when both speak the same vocabulary, so the export copies every
``tokenizer.*`` field of the target's GGUF verbatim (tokens, types, merges, special ids, chat template) after
checking that the drafter's tokenizer has exactly those tokens, and reads the written file back to confirm the
tokenizer metadata equals the target's. Weights are written with the ``gguf`` package in llama.cpp's Llama layout
(tensor names from ``gguf``'s own map; Q and K rows permuted for llama.cpp's rotary embedding, as its
``convert_hf_to_gguf.py`` does); matrices in bf16, q8_0 or q4_0, norms in f32. The output matrix (for a drafter that
shares its embedding table, the table ``token_embd``, which llama.cpp also multiplies as the output layer) can take
another type than the layers (``output_type``): in a small drafter it is most of the weights, so most of the bytes a
draft token streams. Default: q8_0 matrices with a q4_0 output matrix (:data:`DEFAULT_TYPES`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from specdraft.errors import SpecdraftError
from specdraft.export.base import CheckedDrafter, ExportConfig, register
from specdraft.models.gguf_files import same_tokenizer, target_gguf_file, tokenizer_fields

QUANT_TYPES = {"bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0"}
FILE_TYPES = {"bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0"}
OUTPUT_TENSORS = ("token_embd.weight", "output.weight")  # the vocabulary-sized matrices
# Default types (matrices, output matrix): a draft token of the shipped drafter costs 4.8 ms in q8_0, 3.2 ms with a
# q4_0 output matrix, 2.6 ms all q4_0 and 7.7 ms in bf16 (llama-bench, 1 thread, 256 cached tokens, AMD EPYC Zen 3
# with AVX2); llama.cpp accepted 21.0 % of the drafts with the q4_0 output matrix against 22.5 % in q8_0 and 18.8 %
# all q4_0 (draft-simple, 2 draft tokens, 6 Spec-Bench questions): docs/deploy.md.
DEFAULT_TYPES = ("q8_0", "q4_0")


def check_vocabulary(fields: dict[str, tuple], tokenizer, vocab_size: int, path: Path) -> None:
    """Refuse a drafter whose tokenizer is not the target GGUF's: same size, same token at every id."""
    tokens = fields.get("tokenizer.ggml.tokens", (None,))[0]
    if not tokens:
        raise SpecdraftError(f"{path} holds no tokenizer.ggml.tokens")
    if len(tokens) != vocab_size:
        raise SpecdraftError(f"vocabulary mismatch: target GGUF {path.name} has {len(tokens)} tokens, "
                             f"the drafter {vocab_size}")
    mine = tokenizer.convert_ids_to_tokens(list(range(vocab_size)))
    wrong = [i for i, (a, b) in enumerate(zip(mine, tokens, strict=True)) if a != b]
    if wrong:
        i = wrong[0]
        raise SpecdraftError(f"tokenizer mismatch: {len(wrong)} token(s) differ from target GGUF {path.name}, "
                             f"first at id {i}: {mine[i]!r} vs {tokens[i]!r}")
    for key, attr in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id")):
        theirs, ours = fields.get(key, (None,))[0], getattr(tokenizer, attr, None)
        if theirs is not None and ours is not None and int(theirs) != int(ours):
            raise SpecdraftError(f"special token mismatch: {attr} is {ours} in the drafter, {theirs} in {path.name}")


def permute_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """(n_head * head_dim, D) Q or K rows from transformers' rotary layout (halves) to llama.cpp's (pairs)."""
    rows, cols = weight.shape
    return weight.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def gguf_tensors(tensors: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """Drafter tensors under llama.cpp's names, Q and K permuted; ``output.weight`` only when the head is untied."""
    import gguf

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    out = {}
    for key, value in tensors.items():
        if key == "lm_head.weight" and config.get("tie_word_embeddings", False):
            continue
        base, _, suffix = key.rpartition(".")
        name = name_map.get_name(base)
        if name is None or suffix != "weight":
            raise SpecdraftError(f"gguf export: tensor {key!r} has no place in llama.cpp's Llama layout")
        value = value.float()
        if base.endswith("self_attn.q_proj"):
            value = permute_rows(value, heads)
        elif base.endswith("self_attn.k_proj"):
            value = permute_rows(value, kv_heads)
        out[f"{name}.weight"] = value
    return out


def check_architecture(config: dict) -> None:
    """Refuse what the writer does not map: other architectures, rope scaling, biases."""
    if config.get("model_type") != "llama":
        raise SpecdraftError(f"gguf export supports Llama drafters, got model_type {config.get('model_type')!r}")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        raise SpecdraftError(f"gguf export: rope scaling {rope.get('rope_type')!r} is not supported")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise SpecdraftError("gguf export: biases are not supported")


def write_gguf(path: Path, name: str, config: dict, tensors: dict[str, torch.Tensor], fields: dict[str, tuple],
               gguf_type: str, output_type: str | None = None) -> None:
    """Write the GGUF file: llama hyper-parameters, the target's tokenizer fields, the tensors (matrices in
    ``gguf_type``, the vocabulary-sized ones in ``output_type``, default the same)."""
    import gguf

    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type("model")
    writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config["hidden_size"] // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPES[gguf_type]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, (value, types) in fields.items():
        writer.add_key_value(key, value, types[0], sub_type=types[1] if len(types) > 1 else None)
    add_tensors(writer, tensors, gguf_type, output_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_layer_header(writer, name: str, sizes: dict, block_count: int, gguf_type: str) -> None:
    """The hyperparameters llama.cpp reads for a drafter of Llama-shaped decoder layers (EAGLE-3, DFlash): ``sizes``
    holds the target's hidden/FFN/head sizes, ``rms_norm_eps``, ``rope_theta`` and ``max_position_embeddings``."""
    import gguf

    writer.add_type("model")
    writer.add_name(name)
    writer.add_context_length(sizes["max_position_embeddings"])
    writer.add_embedding_length(sizes["hidden_size"])
    writer.add_block_count(block_count)
    writer.add_feed_forward_length(sizes["intermediate_size"])
    writer.add_head_count(sizes["num_attention_heads"])
    writer.add_head_count_kv(sizes["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(sizes["rms_norm_eps"])
    writer.add_rope_freq_base(float(sizes["rope_theta"]))
    writer.add_rope_dimension_count(sizes["head_dim"])
    writer.add_key_length(sizes["head_dim"])
    writer.add_value_length(sizes["head_dim"])
    writer.add_vocab_size(sizes["vocab_size"])
    writer.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPES[gguf_type]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def add_tensors(writer, tensors: dict[str, torch.Tensor], gguf_type: str, output_type: str | None = None) -> None:
    """Add ``tensors`` (llama.cpp names) to a GGUFWriter: vectors f32, vocabulary-sized matrices
    (:data:`OUTPUT_TENSORS`) in ``output_type`` (default ``gguf_type``), other matrices in ``gguf_type``."""
    for key, value in tensors.items():
        kind = (output_type or gguf_type) if key in OUTPUT_TENSORS else gguf_type
        data, qtype = _encode(value, kind)
        writer.add_tensor(key, data, raw_dtype=qtype)


def _encode(value: torch.Tensor, gguf_type: str) -> tuple[np.ndarray, object]:
    """A tensor as GGUF data: f32 for vectors, else bf16, q8_0 or q4_0 (bf16 where a row is not whole blocks)."""
    import gguf

    array = value.float().numpy().astype(np.float32)
    if array.ndim == 1:
        return array, gguf.GGMLQuantizationType.F32
    qtype = getattr(gguf.GGMLQuantizationType, QUANT_TYPES[gguf_type])
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if array.shape[-1] % block:
        qtype = gguf.GGMLQuantizationType.BF16
    return gguf.quants.quantize(array, qtype), qtype


@register("gguf")
def export_gguf(config: ExportConfig, drafter: CheckedDrafter) -> Path:
    from specdraft.models.standalone import standalone_tensors

    check_architecture(drafter.config)
    source = target_gguf_file(drafter.target_name, config.target_gguf)
    fields = tokenizer_fields(source)
    check_vocabulary(fields, drafter.tokenizer, drafter.config["vocab_size"], source)
    tensors = gguf_tensors(standalone_tensors(drafter.folder, drafter.table), drafter.config)
    types = config.gguf_types(DEFAULT_TYPES)
    return write_checked(config.out, source, "gguf", "drafter.gguf",
                         lambda tmp: write_gguf(tmp, Path(drafter.name).name, drafter.config, tensors, fields, *types))


def write_checked(out: str, source: Path, kind: str, example: str, write: Callable[[Path], None],
                  added: dict | None = None) -> Path:
    """Write a GGUF through ``write(path)`` beside ``out``, check that its tokenizer metadata is ``source``'s (with
    the ``added`` fields, e.g. a mask token id, set on top), then rename it into place (nothing is left
    half-written)."""
    path = Path(out).expanduser()
    if path.is_dir():
        raise SpecdraftError(f"{path} is a folder; {kind} export writes a file (e.g. {path / example})")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        if not same_tokenizer(tmp, source, added):
            raise SpecdraftError(f"tokenizer metadata of the written GGUF differs from {source}")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
