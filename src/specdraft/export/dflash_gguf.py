"""``--format dflash-gguf``: DFlash heads (block diffusion drafting on the target's hidden features, arXiv
2602.06036) as a llama.cpp draft model (``llama-server -md dflash.gguf --spec-type draft-dflash``).

llama.cpp's ``dflash`` architecture has two graphs. The encoder graph fuses the features of the target layers named
by ``dflash.target_layers`` (llama.cpp reads the *input* of each of those layers, so the GGUF stores the heads'
``target_layer_ids`` + 1) through ``fc`` and the RMSNorm ``enc.output_norm``, and writes every draft layer's K
(``attn_k``, ``attn_k_norm``, RoPE) and V (``attn_v``) for the committed positions into the draft's KV cache. The
decoder graph embeds the block ``[last token, MASK x n]`` with ``token_embd``, runs Qwen3 decoder layers with
non-causal attention over cache and block (``attn_norm``, ``attn_q/k/v``, ``attn_q_norm``/``attn_k_norm`` over a
head, ``attn_output``, ``ffn_norm``, SwiGLU ``ffn_gate/up/down``), ``output_norm`` and ``output``, and drafts from
rows 1..n. RoPE is NeoX-style (transformers' halves), so Q and K rows are written as they are.

What the file holds besides the heads' weights: the target GGUF's ``tokenizer.*`` fields verbatim plus
``tokenizer.ggml.mask_token_id`` (llama.cpp's block filler); ``token_embd`` = the target's embedding table with the
mask row replaced by the heads' trained ``mask_embedding``; ``output`` = the heads' own LM head over a draft
vocabulary with ``d2t`` (absolute target ids, int64), or, for heads that draft with the target's head, that head
unchanged (the mask row of ``token_embd`` must not leak into the logits: llama.cpp would otherwise multiply
``token_embd`` as the output). This is what llama.cpp's converter (``DFlashModel`` with ``mask_embedding.pt``)
writes for a z-lab ``DFlashDraftModel`` checkpoint.

Types (``--gguf-type`` for the layers and ``fc``, ``--gguf-output-type`` for ``token_embd`` and ``output``): q8_0
for both by default. SmolLM2's GGUF stores its table in q8_0, so the q8_0 copy is that table bit for bit; the layers
are a few million parameters beside the 28.3M of a 49,152 x 576 output matrix, so their type changes little of what
a draft costs, and all-q4_0 drafters lost acceptance in llama.cpp (docs/deploy.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specdraft.errors import SpecdraftError
from specdraft.export.base import CheckedDrafter, ExportConfig, register
from specdraft.export.gguf import add_layer_header, add_tensors, write_checked
from specdraft.models.gguf_files import target_gguf_file, tokenizer_fields

ARCH = "dflash"
KIND = "dflash"
MASK_KEY = "tokenizer.ggml.mask_token_id"
DEFAULT_TYPES = ("q8_0", "q8_0")
SPEC_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
             "block_size", "mask_token_id", "target_layer_ids")
LAYER_NAMES = {  # heads' layer tensor -> llama.cpp's (blk.N.)
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
NAMES = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight", "norm.weight": "output_norm.weight",
         "lm_head.weight": "output.weight"}


def check_spec(spec: dict, where: Path) -> dict:
    """The contract's spec of DFlash heads, checked: every key present, sizes positive, ids in range."""
    missing = [k for k in SPEC_KEYS if k not in spec]
    if missing:
        raise SpecdraftError(f"{where}: the dflash spec lacks {', '.join(missing)}")
    ints = [k for k in SPEC_KEYS if k not in ("rms_norm_eps", "rope_theta", "target_layer_ids")]
    if any(not isinstance(spec[k], int) or spec[k] < 0 for k in ints):
        raise SpecdraftError(f"{where}: the dflash spec's sizes must be non-negative integers")
    layers = spec["target_layer_ids"]
    if not isinstance(layers, list) or not layers or any(not isinstance(i, int) or i < 0 for i in layers):
        raise SpecdraftError(f"{where}: target_layer_ids must be a non-empty list of layer ids, got {layers!r}")
    if not 0 <= spec["mask_token_id"] < spec["vocab_size"]:
        raise SpecdraftError(f"{where}: mask_token_id {spec['mask_token_id']} is outside the vocabulary")
    if spec["block_size"] < 2:
        raise SpecdraftError(f"{where}: block_size must be at least 2 (the last token and one mask)")
    return spec


def expected_shapes(spec: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the heads (the contract's names) and its shape."""
    h, hd, ff = spec["hidden_size"], spec["head_dim"], spec["intermediate_size"]
    q, kv = spec["num_attention_heads"] * hd, spec["num_key_value_heads"] * hd
    shapes = {"fc.weight": (h, len(spec["target_layer_ids"]) * h), "hidden_norm.weight": (h,),
              "norm.weight": (h,), "mask_embedding": (h,)}
    per_layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                 "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                 "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                 "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
                 "mlp.gate_proj.weight": (ff, h), "mlp.up_proj.weight": (ff, h), "mlp.down_proj.weight": (h, ff)}
    for layer in range(spec["num_layers"]):
        shapes |= {f"layers.{layer}.{name}": shape for name, shape in per_layer.items()}
    if spec.get("draft_vocab_size"):
        shapes |= {"lm_head.weight": (spec["draft_vocab_size"], h), "d2t": (spec["draft_vocab_size"],)}
    return shapes


def load_dflash_weights(folder: Path, spec: dict) -> dict[str, torch.Tensor]:
    """The heads' tensors from ``heads.safetensors``, every name and shape checked against ``spec``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from specdraft.heads import WEIGHTS_FILE

    try:
        weights = load_file(str(folder / WEIGHTS_FILE))
    except (OSError, SafetensorError, ValueError) as exc:
        raise SpecdraftError(f"cannot read {folder / WEIGHTS_FILE}: {str(exc).splitlines()[0][:200]}") from None
    shapes = expected_shapes(spec)
    missing, extra = sorted(set(shapes) - set(weights)), sorted(set(weights) - set(shapes))
    if missing or extra:
        raise SpecdraftError(f"{folder / WEIGHTS_FILE} does not match its dflash spec: "
                             f"missing {missing[:4] or 'nothing'}, unexpected {extra[:4] or 'nothing'}")
    wrong = [f"{k} {tuple(weights[k].shape)} (spec: {s})" for k, s in shapes.items() if tuple(weights[k].shape) != s]
    if wrong:
        raise SpecdraftError(f"{folder / WEIGHTS_FILE} does not match its dflash spec: {wrong[0]}")
    if "d2t" in weights:
        d2t = weights["d2t"].long()
        if d2t.min() < 0 or d2t.max() >= spec["vocab_size"] or d2t.unique().numel() != d2t.numel():
            raise SpecdraftError(f"{folder / WEIGHTS_FILE}: d2t must hold distinct target ids below "
                                 f"{spec['vocab_size']}")
    return weights


def check_dflash_heads(config: ExportConfig) -> CheckedDrafter:
    """The DFlash heads folder of ``config.drafter``, checked against its target (``config.target``, else the one
    the heads name): kind, spec, weights, vocabulary, hidden size and feature layers. ``table`` is the target's
    embedding table (the draft embeds its block with it)."""
    from specdraft.heads import read_heads_config
    from specdraft.models.registry import load_model, resolve_heads

    folder = resolve_heads(config.drafter)
    meta = read_heads_config(folder)
    if meta["kind"] != KIND:
        raise SpecdraftError(f"--format dflash-gguf exports DFlash heads (kind dflash); {folder} holds "
                             f"{meta['kind']} heads")
    spec = check_spec(meta["spec"], folder)
    load_dflash_weights(folder, spec)
    target_name = config.target or str(meta.get("target", ""))
    if not target_name:
        raise SpecdraftError(f"{folder} names no target: pass --target")
    target = load_model(target_name)
    layers = getattr(getattr(target, "config", None), "num_hidden_layers", None)
    embed, _ = target_weights_of(target)
    if tuple(embed.shape) != (spec["vocab_size"], spec["hidden_size"]) or (
            layers is not None and max(spec["target_layer_ids"]) >= layers):
        raise SpecdraftError(f"{folder} does not fit target {target_name!r}: heads for vocabulary "
                             f"{spec['vocab_size']}, hidden size {spec['hidden_size']}, target layers "
                             f"{spec['target_layer_ids']}; target embeddings {tuple(embed.shape)}, {layers} layers")
    return CheckedDrafter(config.drafter, folder, target_name, meta, None, embed)


def target_weights_of(target) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding table (V, D), LM head (V, D)) of a loaded target."""
    from specdraft.models.shared_embeddings import target_weights

    embed, head = target_weights(target)
    return embed.detach().float(), head.detach().float()


def dflash_gguf_tensors(weights: dict[str, torch.Tensor], spec: dict, embed: torch.Tensor,
                        head: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], np.ndarray | None]:
    """(floating tensors under llama.cpp's names, ``d2t`` (V_d,) int64 target ids or None).

    ``embed`` (V, H) and ``head`` (V, H) are the target's embedding table and LM head: ``token_embd`` is ``embed``
    with row ``mask_token_id`` = ``mask_embedding``; ``output`` is the heads' ``lm_head`` (V_d, H) when they have a
    draft vocabulary, else ``head`` (then required).
    """
    table = embed.clone()  # (V, H)
    table[spec["mask_token_id"]] = weights["mask_embedding"].float()
    out = {"token_embd.weight": table}
    for key, value in weights.items():
        if key in NAMES:
            out[NAMES[key]] = value.float()
        elif key.startswith("layers."):
            _, layer, name = key.split(".", 2)
            out[f"blk.{int(layer)}.{LAYER_NAMES[name]}"] = value.float()
    if "output.weight" not in out:
        if head is None:
            raise SpecdraftError("dflash-gguf: heads without a draft vocabulary need the target's LM head")
        out["output.weight"] = head.float()  # (V, H): the target's head, without the mask row
    d2t = weights["d2t"].numpy().astype(np.int64) if "d2t" in weights else None
    return out, d2t


def write_dflash_gguf(path: Path, spec: dict, tensors: dict[str, torch.Tensor], d2t: np.ndarray | None,
                      fields: dict[str, tuple], gguf_type: str, output_type: str | None) -> None:
    """The GGUF of llama.cpp's ``dflash`` architecture, with the target's tokenizer ``fields`` and the mask id."""
    import gguf

    writer = gguf.GGUFWriter(str(path), ARCH)
    add_layer_header(writer, "dflash", spec, spec["num_layers"], gguf_type)
    writer.add_uint32(f"{ARCH}.block_size", spec["block_size"])
    writer.add_array(f"{ARCH}.target_layers", [i + 1 for i in spec["target_layer_ids"]])  # inputs of these layers
    for key, (value, types) in fields.items():
        if key != MASK_KEY:
            writer.add_key_value(key, value, types[0], sub_type=types[1] if len(types) > 1 else None)
    writer.add_mask_token_id(spec["mask_token_id"])
    add_tensors(writer, tensors, gguf_type, output_type)
    if d2t is not None:
        writer.add_tensor("d2t", d2t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@register("dflash-gguf", check=check_dflash_heads)
def export_dflash_gguf(config: ExportConfig, checked: CheckedDrafter) -> Path:
    """``specdraft export HEADS --format dflash-gguf --out dflash.gguf [--gguf-type q4_0]``."""
    from specdraft.models.registry import load_model

    spec = checked.config["spec"]
    weights = load_dflash_weights(checked.folder, spec)
    source = target_gguf_file(checked.target_name, config.target_gguf)
    fields = tokenizer_fields(source)
    tokens = fields.get("tokenizer.ggml.tokens", (None,))[0] or []
    if len(tokens) != spec["vocab_size"]:
        raise SpecdraftError(f"vocabulary mismatch: target GGUF {source.name} has {len(tokens)} tokens, the heads "
                             f"draft for {spec['vocab_size']}")
    head = None if spec.get("draft_vocab_size") else target_weights_of(load_model(checked.target_name))[1]
    tensors, d2t = dflash_gguf_tensors(weights, spec, checked.table, head)
    types = config.gguf_types(DEFAULT_TYPES)
    return write_checked(config.out, source, "dflash-gguf", "dflash.gguf",
                         lambda tmp: write_dflash_gguf(tmp, spec, tensors, d2t, fields, *types),
                         added={MASK_KEY: spec["mask_token_id"]})
