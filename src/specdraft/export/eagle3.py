"""EAGLE-3 heads in the flat layout that vLLM, SGLang (``LlamaForCausalLMEagle3``) and llama.cpp
(``convert_hf_to_gguf.py --target-model-dir``, ``--spec-type draft-eagle3``) load.

``config.json``: a one-layer Llama config with ``draft_vocab_size``, ``vocab_size`` = the target's,
``target_hidden_size``, ``norm_before_residual: false`` (vLLM assumes true when it is absent), the aux layers as
input-of-layer indices at the top level (``eagle_aux_hidden_state_layer_ids``, read by vLLM and llama.cpp) and one
lower, as output-of-layer indices, in ``eagle_config`` (SGLang adds one back).
``model.safetensors``: ``fc.weight`` (D, kD), ``midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.
weight``, ``midlayer.self_attn.{q,k,v,o}_proj.weight`` (q, k, v read 2D), ``midlayer.mlp.{gate,up,down}_proj.
weight``, ``norm.weight``, ``lm_head.weight`` (N, D), ``d2t`` (N,) int64 (target id = i + d2t[i]) and ``t2d`` (V,)
bool. No ``embed_tokens``: every engine then uses the target's embedding table, as the head was trained to.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdraft.errors import SpecdraftError
from specdraft.export.base import CheckedDrafter, ExportConfig, register
from specdraft.files import build_folder

ARCHITECTURE = "LlamaForCausalLMEagle3"


def eagle3_tensors(head, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head's weights under the engines' names (floating tensors in ``dtype``, d2t int64, t2d bool)."""
    if getattr(head, "sampling", None) is not None:
        raise SpecdraftError("these EAGLE-3 heads were trained with FSPAD's feature sampling (fspad_sampling), which "
                             "the engines' EAGLE-3 format has no place for: they run in specdraft only")
    layer, sizes = head.layer, head.sizes
    q_rows = sizes["num_attention_heads"] * sizes["head_dim"]
    kv_rows = sizes["num_key_value_heads"] * sizes["head_dim"]
    q, k, v = layer.qkv_weight.split((q_rows, kv_rows, kv_rows))
    gate, up = layer.gate_up_weight.chunk(2)
    floats = {
        "fc.weight": head.fc.weight, "midlayer.input_layernorm.weight": layer.attn_norm,
        "midlayer.hidden_norm.weight": layer.hidden_norm, "midlayer.self_attn.q_proj.weight": q,
        "midlayer.self_attn.k_proj.weight": k, "midlayer.self_attn.v_proj.weight": v,
        "midlayer.self_attn.o_proj.weight": layer.o_weight,
        "midlayer.post_attention_layernorm.weight": layer.mlp_norm, "midlayer.mlp.gate_proj.weight": gate,
        "midlayer.mlp.up_proj.weight": up, "midlayer.mlp.down_proj.weight": layer.down_weight,
        "norm.weight": head.norm, "lm_head.weight": head.lm_head.weight,
    }
    if layer.qkv_bias is not None:
        for name, part in zip("qkv", layer.qkv_bias.split((q_rows, kv_rows, kv_rows)), strict=True):
            floats[f"midlayer.self_attn.{name}_proj.bias"] = part
    for name, bias in (("self_attn.o_proj", layer.o_bias), ("mlp.down_proj", layer.down_bias)):
        if bias is not None:
            floats[f"midlayer.{name}.bias"] = bias
    if layer.gate_up_bias is not None:
        floats["midlayer.mlp.gate_proj.bias"], floats["midlayer.mlp.up_proj.bias"] = layer.gate_up_bias.chunk(2)
    tensors = {name: t.detach().to(dtype).contiguous() for name, t in floats.items()}
    tensors["d2t"] = head.d2t.to(torch.int64).contiguous()
    tensors["t2d"] = head.t2d.to(torch.bool).contiguous()
    return tensors


def eagle3_config(head, dtype: torch.dtype, target: str = "") -> dict:
    """The engines' ``config.json`` for ``head``."""
    sizes, layers = head.sizes, list(head.aux_layers)
    if len(layers) != 3:
        raise SpecdraftError(f"the EAGLE-3 format has three aux layers; these heads read {len(layers)}: {layers}")
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": sizes["hidden_size"], "intermediate_size": sizes["intermediate_size"],
        "num_attention_heads": sizes["num_attention_heads"], "num_key_value_heads": sizes["num_key_value_heads"],
        "head_dim": sizes["head_dim"], "hidden_act": "silu", "rms_norm_eps": sizes["rms_norm_eps"],
        "rope_theta": sizes["rope_theta"], "rope_scaling": None,
        "max_position_embeddings": sizes["max_position_embeddings"], "attention_bias": sizes["attention_bias"],
        "mlp_bias": sizes["mlp_bias"], "tie_word_embeddings": False, "vocab_size": sizes["vocab_size"],
        "draft_vocab_size": sizes["draft_vocab_size"], "target_hidden_size": sizes["hidden_size"],
        "norm_before_residual": False, "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_aux_hidden_state_layer_ids": layers,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers], "use_aux_hidden_state": True,
                         "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
                         "use_mtp_layernorm": False},
        "specdraft_target": target,
    }


def export_eagle3(heads: str | Path, out: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the heads folder ``heads`` (``train-heads --kind eagle3``) to ``out`` in the engines' layout,
    replacing an old ``out`` only once the new one is complete."""
    from safetensors.torch import save_file

    from specdraft.heads import load_heads

    meta, head = load_heads(heads, kind="eagle3")

    def fill(tmp: Path) -> None:
        save_file(eagle3_tensors(head, dtype), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = eagle3_config(head, dtype, str(meta.get("target", "")))
        (tmp / "config.json").write_text(json.dumps(config, indent=1) + "\n")

    return build_folder(Path(out), fill)


def check_heads(config: ExportConfig) -> CheckedDrafter:
    """The heads folder of ``config.drafter``, checked against its target (``config.target``, else the one the
    heads name): vocabulary, hidden size and layers."""
    from specdraft.heads import load_heads, read_heads_config
    from specdraft.models.registry import load_model, resolve_heads
    from specdraft.models.shared_embeddings import target_weights

    folder = resolve_heads(config.drafter)
    meta = read_heads_config(folder)
    if meta["kind"] != "eagle3":
        raise SpecdraftError(f"--format eagle3 exports EAGLE-3 heads (train-heads --kind eagle3); {folder} holds "
                             f"{meta['kind']} heads")
    target_name = config.target or str(meta.get("target", ""))
    _, head = load_heads(folder, kind="eagle3")
    target = load_model(target_name)
    layers = getattr(getattr(target, "config", None), "num_hidden_layers", None)
    embed, _ = target_weights(target)
    if tuple(embed.shape) != (head.sizes["vocab_size"], head.sizes["hidden_size"]) or (
            layers is not None and max(head.aux_layers) >= layers):
        raise SpecdraftError(f"{folder} does not fit target {target_name!r}: heads for vocabulary "
                             f"{head.sizes['vocab_size']}, hidden size {head.sizes['hidden_size']}, layers "
                             f"{head.aux_layers}; target embeddings {tuple(embed.shape)}, {layers} layers")
    return CheckedDrafter(config.drafter, folder, target_name, meta, None, None)


@register("eagle3", check=check_heads)
def _export(config: ExportConfig, checked: CheckedDrafter) -> Path:
    """``specdraft export HEADS --format eagle3 --out DIR`` (bf16 weights)."""
    return export_eagle3(checked.folder, Path(config.out).expanduser())
