"""The drafter's architecture, derived from the target (Goel et al. 2024, arXiv 2403.00858: a small, shallow
Llama that shares the target's tokenizer, trained from scratch and then aligned by distillation).

The drafter keeps everything that speculative decoding compares token for token: the vocabulary size, the
bos/eos/pad ids and the rotary settings. It ties its input and output embeddings (the 49k-wide LM head dominates
a small draft's cost and parameters) and is shallow: per-layer overhead, not width, dominates draft latency on CPU.

Optional initialisation from the target (:func:`init_embeddings_from_target`): the target's token embedding
table E (V, D) is copied when the widths match; otherwise it is projected onto its top-d right singular vectors,
E V_d (V, d), the rank-d linear map that keeps most of E's energy (PCA without centring), then rescaled so that
its entries have the target's RMS.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import LlamaConfig

from specdraft.errors import SpecdraftError

# name -> (num_layers, hidden_size, num_heads, num_kv_heads, intermediate_size); head_dim 32 everywhere.
PRESETS: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (2, 128, 4, 2, 384),
    "small": (2, 192, 6, 2, 512),
    "base": (4, 256, 8, 4, 768),
}
MAX_POSITIONS = 2048


@dataclass(frozen=True)
class DrafterConfig:
    """A size preset plus explicit overrides; :meth:`llama_config` turns it into a transformers ``LlamaConfig``."""

    preset: str = field(default="tiny", metadata={"help": f"size preset: {', '.join(PRESETS)}"})
    num_layers: int | None = field(default=None, metadata={"help": "override the preset's layer count"})
    hidden_size: int | None = field(default=None, metadata={"help": "override the preset's width d"})
    num_heads: int | None = field(default=None, metadata={"help": "override the preset's attention heads"})
    num_kv_heads: int | None = field(default=None, metadata={"help": "override the preset's key/value heads"})
    intermediate_size: int | None = field(default=None, metadata={"help": "override the preset's FFN width"})
    max_positions: int = field(default=MAX_POSITIONS, metadata={"help": "context cap (min with the target's)"})

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise SpecdraftError(f"preset must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size", "max_positions"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise SpecdraftError(f"{name} must be an integer >= 1, got {value!r}")
        _, hidden, heads, kv_heads, _ = self.sizes()
        if hidden % heads:
            raise SpecdraftError(f"hidden_size {hidden} is not a multiple of num_heads {heads}")
        if (hidden // heads) % 2:
            raise SpecdraftError(f"head dim hidden_size / num_heads = {hidden // heads} must be even (rotary)")
        if heads % kv_heads:
            raise SpecdraftError(f"num_heads {heads} is not a multiple of num_kv_heads {kv_heads}")

    def sizes(self) -> tuple[int, int, int, int, int]:
        """(num_layers, hidden_size, num_heads, num_kv_heads, intermediate_size) after the overrides."""
        preset = PRESETS[self.preset]
        names = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size")
        pairs = zip(names, preset, strict=True)
        return tuple(getattr(self, n) if getattr(self, n) is not None else p for n, p in pairs)

    def llama_config(self, target_config) -> LlamaConfig:
        """The drafter's ``LlamaConfig``: this config's sizes, the target's vocabulary, special ids and rotary."""
        layers, hidden, heads, kv_heads, ffn = self.sizes()
        rope = dict(getattr(target_config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 1e4})
        return LlamaConfig(
            vocab_size=target_config.vocab_size, hidden_size=hidden, intermediate_size=ffn,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=hidden // heads, hidden_act="silu", tie_word_embeddings=True,
            max_position_embeddings=min(self.max_positions, target_config.max_position_embeddings),
            rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-5), rope_parameters=rope,
            bos_token_id=target_config.bos_token_id, eos_token_id=target_config.eos_token_id,
            pad_token_id=getattr(target_config, "pad_token_id", None), initializer_range=0.02,
        )


def project_embeddings(target_embedding: torch.Tensor, width: int) -> torch.Tensor:
    """The target's embedding table at the drafter's width.

    Args:
        target_embedding: (V, D) the target's token embeddings.
        width: d, the drafter's hidden size.
    Returns:
        (V, d) float32: a copy when d == D; else E V_d (top-d right singular vectors; when d > D the extra columns
        are zero), rescaled to the RMS of E.
    """
    table = target_embedding.detach().float()  # (V, D)
    if table.shape[1] == width:
        return table.clone()
    _, _, vh = torch.linalg.svd(table, full_matrices=False)  # vh: (min(V, D), D)
    basis = vh[: min(width, vh.shape[0])].T  # (D, k)
    projected = table @ basis  # (V, k)
    if projected.shape[1] < width:
        projected = torch.cat([projected, projected.new_zeros(table.shape[0], width - projected.shape[1])], dim=1)
    rms_target, rms_projected = table.pow(2).mean().sqrt(), projected.pow(2).mean().sqrt().clamp_min(1e-12)
    return projected * (rms_target / rms_projected)  # (V, d)


@torch.no_grad()
def init_embeddings_from_target(drafter, target_embedding: torch.Tensor) -> None:
    """Overwrite a drafter's (tied) token embeddings with :func:`project_embeddings` of the target's table."""
    weight = drafter.get_input_embeddings().weight  # (V, d)
    if target_embedding.shape[0] != weight.shape[0]:
        raise SpecdraftError(f"vocabulary mismatch: target embeddings have {target_embedding.shape[0]} rows, "
                             f"the drafter {weight.shape[0]}")
    weight.copy_(project_embeddings(target_embedding, weight.shape[1]).to(weight.dtype))
