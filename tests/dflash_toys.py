"""Random DFlash heads folders in the shared layout (``heads.safetensors`` with z-lab ``DFlashDraftModel`` names,
``heads.json`` of kind ``dflash``), for tests of what reads them without the trained weights."""

import json
from pathlib import Path

import torch


def dflash_spec(config, num_layers: int = 1, block_size: int = 8, target_layer_ids=(1, 2),
                mask_token_id: int | None = None, draft_vocab_size: int = 0) -> dict:
    """The heads' spec for a target of transformers ``config`` (Llama-like), hidden size the target's."""
    rope = getattr(config, "rope_parameters", None) or {}
    heads = config.num_attention_heads
    return {"vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size, "num_layers": num_layers,
            "num_attention_heads": heads, "num_key_value_heads": config.num_key_value_heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
            "rms_norm_eps": float(config.rms_norm_eps),
            "rope_theta": float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            "max_position_embeddings": config.max_position_embeddings, "block_size": block_size,
            "mask_token_id": config.vocab_size - 1 if mask_token_id is None else mask_token_id,
            "target_layer_ids": list(target_layer_ids), "draft_vocab_size": draft_vocab_size}


def dflash_weights(spec: dict, seed: int = 0, std: float = 0.05) -> dict[str, torch.Tensor]:
    """Random weights of every tensor the contract names for ``spec`` (norm weights near 1, ``d2t`` a sorted random
    subset of the target's ids)."""
    g = torch.Generator().manual_seed(seed)
    h, hd, ff = spec["hidden_size"], spec["head_dim"], spec["intermediate_size"]
    q, kv, k = spec["num_attention_heads"] * hd, spec["num_key_value_heads"] * hd, len(spec["target_layer_ids"])

    def mat(rows, cols):
        return torch.randn(rows, cols, generator=g) * std

    def norm(size):
        return 1 + 0.1 * torch.randn(size, generator=g)

    weights = {"fc.weight": mat(h, k * h), "hidden_norm.weight": norm(h), "norm.weight": norm(h),
               "mask_embedding": torch.randn(h, generator=g) * std}
    for layer in range(spec["num_layers"]):
        p = f"layers.{layer}."
        weights |= {p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
                    p + "self_attn.q_proj.weight": mat(q, h), p + "self_attn.k_proj.weight": mat(kv, h),
                    p + "self_attn.v_proj.weight": mat(kv, h), p + "self_attn.o_proj.weight": mat(h, q),
                    p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
                    p + "mlp.gate_proj.weight": mat(ff, h), p + "mlp.up_proj.weight": mat(ff, h),
                    p + "mlp.down_proj.weight": mat(h, ff)}
    if spec.get("draft_vocab_size"):
        n = spec["draft_vocab_size"]
        weights["lm_head.weight"] = mat(n, h)
        weights["d2t"] = torch.randperm(spec["vocab_size"], generator=g)[:n].sort().values.to(torch.int64)
    return weights


def write_dflash_heads(folder, spec: dict, target: str, seed: int = 0, weights: dict | None = None) -> Path:
    """A heads folder of kind ``dflash`` holding ``weights`` (default: :func:`dflash_weights`)."""
    from safetensors.torch import save_file

    from specdraft.heads import CONFIG_FILE, WEIGHTS_FILE

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = dflash_weights(spec, seed) if weights is None else weights
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / WEIGHTS_FILE))
    meta = {"format": 1, "kind": "dflash", "spec": spec, "target": target}
    (folder / CONFIG_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    (folder / "README.md").write_text("# random dflash heads (tests)\n")
    return folder
