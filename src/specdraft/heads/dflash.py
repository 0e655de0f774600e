"""The DFlash drafter (Chen et al. 2026, "DFlash: Block Diffusion for Flash Speculative Decoding", arXiv 2602.06036):
a small stack of Qwen3 decoder layers that drafts a whole block of tokens in one non-causal forward, conditioned on
the target's hidden features; llama.cpp's ``draft-dflash`` (``src/models/dflash.cpp``) runs the same computation.

Features. For each id i of ``target_layer_ids`` (0-based, the z-lab / transformers convention) the target's residual
stream after layer i (the input of layer i + 1) at position t; the k of them are concatenated, a_t (kD,), and fused:

    g_t = hidden_norm(fc(a_t))                                              # (D,), fc: kD -> D, no bias

Context. Every draft layer l turns every committed context position t < n into keys and values of its own, with no
input norm on g and no norm on V (the "context KV injection" of the paper, Sec. 3):

    K_t = rope(k_norm(k_proj_l(g_t)), t),   V_t = v_proj_l(g_t)

Block. With the last committed token x_n at position n (the target has not seen it yet, so it has no feature), the
block is [x_n, MASK, ..., MASK] (``block_size`` tokens) at positions n .. n + B - 1; its rows start as the target's
embeddings E[x_n] and, for the masks, the drafter's own ``mask_embedding`` (D,). Each layer is a Qwen3 block:

    x = input_layernorm(h);  q, k, v = q_norm(q_proj x), k_norm(k_proj x), v_proj x  (rope at block positions)
    h = h + o_proj(Attention(q, [K_ctx; k], [V_ctx; v]))     # non-causal: every row sees the context and the block
    h = h + down(silu(gate(y)) * up(y)),  y = post_attention_layernorm(h)

then ``norm`` and the LM head; row j (j = 1 .. B - 1) is the draft distribution q_j of x_{n+j} (row 0 is not read).

LM head: the drafter's own ``lm_head`` (V_d, D) over a draft vocabulary (EAGLE-3's idea, FR-Spec's ranking), with
``d2t`` (V_d,) the absolute target id of each draft row (the GGUF's ``d2t``); every other token gets q = 0.

Names follow z-lab's ``DFlashDraftModel`` (``fc``, ``hidden_norm``, ``layers.{l}.self_attn.q_proj`` ...,
``norm``, ``mask_embedding``, ``lm_head``) with no ``model.`` prefix, so the export renames nothing but the prefix.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.models.native_llama import rotate

SPEC_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings", "block_size",
             "mask_token_id", "target_layer_ids", "draft_vocab_size")


def default_target_layer_ids(num_layers: int, count: int = 5) -> list[int]:
    """``count`` target layers spread evenly from layer 1 to layer n - 3 (z-lab's ``build_target_layer_ids``): low,
    middle and high features; never the last layers, whose output is close to the next-token logits already."""
    if num_layers < 5:
        return list(range(num_layers - 1)) or [0]
    start, end = 1, num_layers - 3
    return sorted({round(start + i * (end - start) / max(count - 1, 1)) for i in range(count)})


class DFlashAttention(nn.Module):
    """Qwen3 attention (q_norm and k_norm over head_dim) whose keys and values are the context's, from the target
    features, then the block's own."""

    def __init__(self, spec: dict) -> None:
        super().__init__()
        hidden, hd = spec["hidden_size"], spec["head_dim"]
        self.num_heads, self.num_kv_heads, self.head_dim = spec["num_attention_heads"], spec["num_key_value_heads"], hd
        self.q_proj = nn.Linear(hidden, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, hidden, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=spec["rms_norm_eps"])
        self.k_norm = nn.RMSNorm(hd, eps=spec["rms_norm_eps"])

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, D) inputs -> keys and values (B, K, T, hd); ``cos``, ``sin``: (B, T, 1, hd/2) or (T, 1, hd/2)."""
        batch, length = x.shape[:2]
        key = self.k_norm(self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim))
        value = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        return rotate(key, cos, sin).transpose(1, 2), value.transpose(1, 2)

    def forward(self, x: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor], cos: torch.Tensor,
                sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Block rows (B, T, D) attend the context keys and values (B, K, S, hd each) and every block row (``mask``
        (B, 1, T, S + T) bool, True = attend; None = all). Returns (B, T, D)."""
        batch, length = x.shape[:2]
        query = self.q_norm(self.q_proj(x).view(batch, length, self.num_heads, self.head_dim))
        query = rotate(query, cos, sin).transpose(1, 2)  # (B, H, T, hd)
        key, value = self.keys_values(x, cos, sin)  # (B, K, T, hd)
        keys, values = torch.cat([context[0], key], dim=2), torch.cat([context[1], value], dim=2)  # (B, K, S+T, hd)
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=1.0 / math.sqrt(self.head_dim),
                                             enable_gqa=True)  # (B, H, T, hd)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim))


class DFlashMLP(nn.Module):
    def __init__(self, spec: dict) -> None:
        super().__init__()
        hidden, inner = spec["hidden_size"], spec["intermediate_size"]
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    """One Qwen3 decoder layer of the drafter (module docstring)."""

    def __init__(self, spec: dict) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(spec["hidden_size"], eps=spec["rms_norm_eps"])
        self.self_attn = DFlashAttention(spec)
        self.post_attention_layernorm = nn.RMSNorm(spec["hidden_size"], eps=spec["rms_norm_eps"])
        self.mlp = DFlashMLP(spec)

    def forward(self, h: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor], cos: torch.Tensor,
                sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), context, cos, sin, mask)  # (B, T, D)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashHead(nn.Module):
    """fc, hidden_norm, the draft layers, norm, mask_embedding and lm_head with d2t (module docstring).

    ``spec``: the sizes and settings of :data:`SPEC_KEYS`; ``draft_token_ids`` (V_d,), when given, set d2t (else it
    comes from the weights)."""

    def __init__(self, spec: dict, draft_token_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self.spec = {key: spec[key] for key in SPEC_KEYS}
        hidden, vocab, draft = spec["hidden_size"], spec["vocab_size"], spec["draft_vocab_size"]
        self.target_layer_ids = [int(i) for i in spec["target_layer_ids"]]
        self.block_size, self.mask_token_id = int(spec["block_size"]), int(spec["mask_token_id"])
        if self.block_size < 2 or not self.target_layer_ids or draft < 1 or spec["hidden_size"] % 2:
            raise SpecdraftError(f"a DFlash head needs block_size >= 2, target layers and a draft vocabulary: {spec}")
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = nn.RMSNorm(hidden, eps=spec["rms_norm_eps"])
        self.layers = nn.ModuleList(DFlashLayer(spec) for _ in range(spec["num_layers"]))
        self.norm = nn.RMSNorm(hidden, eps=spec["rms_norm_eps"])
        self.mask_embedding = nn.Parameter(torch.zeros(hidden))
        self.lm_head = nn.Linear(hidden, draft, bias=False)
        for parameter in self.parameters():
            if parameter.dim() == 2:
                nn.init.normal_(parameter, 0.0, 0.02)
        nn.init.normal_(self.mask_embedding, 0.0, 0.02)
        ids = torch.arange(draft) if draft_token_ids is None else torch.as_tensor(draft_token_ids, dtype=torch.long)
        if ids.shape != (draft,) or int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != draft:
            raise SpecdraftError(f"draft vocabulary must be {draft} distinct target token ids below {vocab}")
        self.register_buffer("d2t", ids.sort().values)  # (V_d,) absolute target ids
        hd = spec["head_dim"]
        inv_freq = 1.0 / (float(spec["rope_theta"]) ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (hd/2,)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the dense weights (norms), also where the linear layers run on other kernels."""
        return self.norm.weight.dtype

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(..., T) positions -> cos, sin (..., T, 1, hd/2) in the head's dtype (angles in fp32)."""
        angles = positions.float()[..., None] * self.inv_freq  # (..., T, hd/2)
        return angles.cos()[..., None, :].to(self.dtype), angles.sin()[..., None, :].to(self.dtype)

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """(..., kD) concatenated target features -> g (..., D)."""
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    def context(self, g: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys and values (B, K, S, hd) of encoded context features g (B, S, D) at ``positions``
        ((S,) or (B, S))."""
        cos, sin = self.rope(positions)
        return [layer.self_attn.keys_values(g, cos, sin) for layer in self.layers]

    def block_embeddings(self, anchors: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """(...,) anchor token ids -> (..., B, D): E[anchor] then ``block_size - 1`` mask embeddings."""
        first = F.embedding(anchors, embed).to(self.dtype)[..., None, :]  # (..., 1, D)
        masks = self.mask_embedding.to(self.dtype).expand(*anchors.shape, self.block_size - 1, -1)  # (..., B-1, D)
        return torch.cat([first, masks], dim=-2)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, context: list[tuple[torch.Tensor, torch.Tensor]],
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Block rows h (B, T, D) at ``positions`` ((T,) or (B, T)) over the context of :meth:`context`; ``mask``
        (B, 1, T, S + T) bool or None (every row sees everything). Returns the final-normed rows (B, T, D)."""
        cos, sin = self.rope(positions)
        h = h.to(self.dtype)
        for layer, kv in zip(self.layers, context, strict=True):
            h = layer(h, kv, cos, sin, mask)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., D) final-normed rows -> (..., V_d) draft-vocabulary logits."""
        return self.lm_head(hidden)


def build_dflash(spec: dict, draft_token_ids: torch.Tensor | None = None) -> DFlashHead:
    """A fresh head from a spec (``heads.json``'s ``spec``); training settings ride along as ``train_settings``."""
    try:
        head = DFlashHead(spec, draft_token_ids)
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecdraftError(f"bad DFlash head spec: {exc!r}") from None
    head.train_settings = {k: v for k, v in spec.items() if k not in SPEC_KEYS}
    return head


__all__ = ["SPEC_KEYS", "DFlashHead", "build_dflash", "default_target_layer_ids"]
