"""``--format eagle3-gguf``: EAGLE-3 heads (Li et al. 2025, arXiv 2503.01840) as a llama.cpp draft model
(``llama-server -md eagle3.gguf --spec-type draft-eagle3``).

llama.cpp's ``eagle3`` architecture is one decoder layer whose attention reads the concatenation of the normed token
embedding and the normed fused feature (``fc`` over the target's three aux layers), an output norm, an LM head over
the draft vocabulary and ``d2t``, the target id of every draft id (absolute, int64). Without ``token_embd`` it
embeds with the target's table, as the heads were trained to. This writes the same file its
``convert_hf_to_gguf.py --target-model-dir`` makes from ``--format eagle3`` (same names, metadata, Q and K rows
permuted for its rotary layout), with the target GGUF's tokenizer fields copied verbatim, and with the matrices in
bf16, q8_0 or q4_0 (``--gguf-type``, default q4_0; the LM head in ``--gguf-output-type``). The draft vocabulary
makes the LM head small (8,192 x 576 for the shipped heads against 49,152 x 576 in a draft model of the full
vocabulary), so a draft token costs little next to a target step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specdraft.errors import SpecdraftError
from specdraft.export.base import CheckedDrafter, ExportConfig, register
from specdraft.export.eagle3 import check_heads, eagle3_tensors
from specdraft.export.gguf import add_layer_header, add_tensors, permute_rows, write_checked
from specdraft.models.gguf_files import target_gguf_file, tokenizer_fields

ARCH = "eagle3"
# Default types: llama.cpp accepted as many of the shipped heads' drafts in q4_0 as in bf16 (24.6 % and 24.2 %,
# draft-eagle3, 2 draft tokens, 6 Spec-Bench questions; docs/deploy.md), at a third of the bytes.
DEFAULT_TYPES = ("q4_0", "q4_0")
NAMES = {  # --format eagle3's tensor names -> llama.cpp's
    "fc.weight": "fc.weight", "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight", "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight", "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def eagle3_gguf_tensors(head) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    """(floating tensors under llama.cpp's names, Q and K permuted; ``d2t`` as absolute target ids, (N,) int64)."""
    tensors = eagle3_tensors(head, torch.float32)
    extra = sorted(set(tensors) - set(NAMES) - {"d2t", "t2d"})
    if extra:
        raise SpecdraftError(f"llama.cpp's eagle3 architecture has no place for {', '.join(extra)} (biases)")
    sizes = head.sizes
    out = {NAMES[key]: tensors[key] for key in NAMES}
    out["blk.0.attn_q.weight"] = permute_rows(out["blk.0.attn_q.weight"], sizes["num_attention_heads"])
    out["blk.0.attn_k.weight"] = permute_rows(out["blk.0.attn_k.weight"], sizes["num_key_value_heads"])
    d2t = tensors["d2t"].numpy().astype(np.int64)
    return out, d2t + np.arange(d2t.size, dtype=np.int64)  # (N,) target ids


def write_eagle3_gguf(path: Path, head, fields: dict[str, tuple], gguf_type: str, output_type: str | None) -> None:
    """The GGUF of llama.cpp's ``eagle3`` architecture for ``head``, with the target's tokenizer ``fields``."""
    import gguf

    sizes, layers = head.sizes, list(head.aux_layers)
    if len(layers) != 3:
        raise SpecdraftError(f"llama.cpp's eagle3 reads three aux layers; these heads read {len(layers)}: {layers}")
    tensors, d2t = eagle3_gguf_tensors(head)
    writer = gguf.GGUFWriter(str(path), ARCH)
    add_layer_header(writer, "eagle3", sizes, 1, gguf_type)
    writer.add_array(f"{ARCH}.target_layers", layers)  # inputs of these target layers
    writer.add_uint32(f"{ARCH}.target_hidden_size", sizes["hidden_size"])
    writer.add_bool(f"{ARCH}.norm_before_residual", False)
    writer.add_bool(f"{ARCH}.norm_before_fc", False)
    for key, (value, types) in fields.items():
        writer.add_key_value(key, value, types[0], sub_type=types[1] if len(types) > 1 else None)
    add_tensors(writer, tensors, gguf_type, output_type)
    writer.add_tensor("d2t", d2t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@register("eagle3-gguf", check=check_heads)
def export_eagle3_gguf(config: ExportConfig, checked: CheckedDrafter) -> Path:
    """``specdraft export HEADS --format eagle3-gguf --out eagle3.gguf [--gguf-type q8_0]``."""
    from specdraft.heads import load_heads

    _, head = load_heads(checked.folder, kind="eagle3")
    source = target_gguf_file(checked.target_name, config.target_gguf)
    fields = tokenizer_fields(source)
    tokens = fields.get("tokenizer.ggml.tokens", (None,))[0] or []
    if len(tokens) != head.sizes["vocab_size"]:
        raise SpecdraftError(f"vocabulary mismatch: target GGUF {source.name} has {len(tokens)} tokens, the heads "
                             f"draft for {head.sizes['vocab_size']}")
    types = config.gguf_types(DEFAULT_TYPES)
    return write_checked(config.out, source, "eagle3-gguf", "eagle3.gguf",
                         lambda tmp: write_eagle3_gguf(tmp, head, fields, *types))
