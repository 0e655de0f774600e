"""The EAGLE-3 draft head (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test", arXiv 2503.01840): one decoder layer on fused low, middle and high target features, with its
own LM head over a draft vocabulary, trained by unrolling it on its own outputs (training-time test).

Features. The target's residual stream entering three of its layers (input-of-layer indices ``aux_layers``,
default ``[2, n // 2, n - 3]``) is concatenated, a_t (3D,), and fused by ``fc`` (no bias): f_t = W_fc a_t (D,).
Pair t is ``(f_t, x_{t+1})`` as in EAGLE; the layer computes

    u = concat(input_layernorm(E[x_{t+1}]), hidden_norm(f_t))          # (2D,): q, k and v read 2D
    h = f_t + Attention(u);  g_t = h + MLP(post_attention_layernorm(h))  # (D,): the next step's feature
    draft logits of x_{t+2} = lm_head(norm(g_t))                          # (N,) over the draft vocabulary

E is the target's embedding table, shared and frozen (never stored here). Beyond the first draft step the head
reads its own outputs: the pair after ``(f_t, x_{t+1})`` on a draft path is ``(g_t, x_{t+2})``, with no fc.

Draft vocabulary (EAGLE-3 and SpecForge's ``d2t`` / ``t2d``): draft index i is target token ``i + d2t[i]``;
``t2d`` (V,) bool marks the target tokens in it. The N most frequent tokens of the training responses.

Training-time test (Sec. 3.2 of the paper; SpecForge's ``OnlineEagle3Model``): step 0 runs the layer on every pair
of a sequence with the target's features; step i runs it again on the pairs ``(g^{i-1}_t, x_{t+1+i})`` built from
step i-1's outputs. Step i at position t is the draft node i levels below the root t, so its query sees the
step-0 keys of positions <= t (the committed context) and the keys of steps 1..i at position t only (its ancestors
and itself), at rotary position t + i: exactly the attention of the node at depth i in a draft tree. This file
implements that mask as a causal score block plus one diagonal score per earlier step (:meth:`Eagle3Layer.unroll`).

Names. The weights follow specdraft's native block (fused ``qkv_weight`` and ``gate_up_weight``); the export to
the engines' layout (``midlayer.self_attn.q_proj.weight`` and so on) splits them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.heads.eagle import llama_config, step_layout
from specdraft.heads.fspad import FeatureSampling
from specdraft.models.native_llama import DecoderLayer, LayerStep, StaticKVCache, rope_table, rotate


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high features as input-of-layer indices: [2, n // 2, n - 3] (n >= 7; shallower
    targets: the distinct ones of [0, n // 2, n - 1])."""
    if num_layers < 7:
        return sorted({0, num_layers // 2, num_layers - 1})
    return [2, num_layers // 2, num_layers - 3]


class Eagle3Layer(DecoderLayer):
    """EAGLE-3's ``midlayer``: a Llama block whose attention reads [input_layernorm(embeds); hidden_norm(features)]
    (2D wide) and whose residual stream is the feature. ``attn_norm`` is ``input_layernorm``, ``mlp_norm`` is
    ``post_attention_layernorm``."""

    def __init__(self, config) -> None:
        super().__init__(config, torch.float32)
        hidden = config.hidden_size
        self.qkv_weight = nn.Parameter(torch.empty(self.qkv_weight.shape[0], 2 * hidden))
        self.hidden_norm = nn.Parameter(torch.ones(hidden))
        for name, parameter in self.named_parameters():
            parameter.requires_grad_(True)
            with torch.no_grad():
                if name.endswith("norm"):
                    parameter.fill_(1.0)
                elif name.endswith("bias"):
                    parameter.zero_()
                else:
                    parameter.normal_(0.0, 0.02)

    def _inputs(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """(B, T, D) twice -> (B, T, 2D): the attention input, embeddings first."""
        embeds = F.rms_norm(embeds, self.attn_norm.shape, self.attn_norm.to(embeds.dtype), self.eps)
        features = F.rms_norm(features, self.hidden_norm.shape, self.hidden_norm.to(features.dtype), self.eps)
        return torch.cat([embeds, features], dim=-1)

    def _finish(self, features: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        hidden = features + attended  # (B, T, D)
        normed = F.rms_norm(hidden, self.mlp_norm.shape, self.mlp_norm.to(hidden.dtype), self.eps)
        return hidden + self._mlp(normed)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, cache: StaticKVCache,
                step: LayerStep) -> torch.Tensor:
        """One draft step on the head's KV cache: (B, T, D) embeddings and features -> (B, T, D) next features."""
        return self._finish(features, self._attention(self._inputs(embeds, features), cache, 0, step))

    def unroll(self, embeds: list[torch.Tensor], features: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               sample=None) -> list[torch.Tensor]:
        """Training-time test over whole sequences: step i reads ``embeds[i]`` (B, T, D) (the tokens x_{t+1+i})
        and step i-1's outputs (step 0: ``features`` (B, T, D)); returns every step's outputs (B, T, D).
        ``cos``, ``sin``: (T + steps, hd/2) rotary tables from position 0. See the module docstring for the mask.
        ``sample(features, embeds)``: FSPAD's feature sampling applied to each step's input features (None: off)."""
        batch, length = features.shape[:2]
        heads, kv_heads, hd = self.num_heads, self.num_kv_heads, self.head_dim
        causal = torch.ones(length, length, dtype=torch.bool, device=features.device).tril()  # (T, T)
        keys, values, outputs = [], [], []
        for i, embed in enumerate(embeds):
            if sample is not None:
                features = sample(features, embed)  # (B, T, D)
            qkv = F.linear(self._inputs(embed, features), self.qkv_weight, self.qkv_bias)
            qkv = qkv.view(batch, length, heads + 2 * kv_heads, hd)  # (B, T, H+2K, hd)
            angle_cos, angle_sin = cos[i : i + length, None], sin[i : i + length, None]  # (T, 1, hd/2)
            rotated = rotate(qkv[:, :, : heads + kv_heads], angle_cos, angle_sin)
            query, key = rotated.split((heads, kv_heads), dim=2)  # (B, T, H, hd), (B, T, K, hd)
            groups = heads // kv_heads
            keys.append(key.repeat_interleave(groups, dim=2).transpose(1, 2))  # (B, H, T, hd)
            values.append(qkv[:, :, heads + kv_heads :].repeat_interleave(groups, dim=2).transpose(1, 2))
            query = query.transpose(1, 2) / math.sqrt(hd)  # (B, H, T, hd)
            scores = (query @ keys[0].transpose(-1, -2)).masked_fill(~causal, float("-inf"))  # (B, H, T, T)
            diagonal = [(query * k).sum(-1, keepdim=True) for k in keys[1:]]  # i x (B, H, T, 1)
            weights = torch.softmax(torch.cat([scores, *diagonal], dim=-1).float(), dim=-1).to(query.dtype)
            attended = weights[..., :length] @ values[0]  # (B, H, T, hd)
            for j, value in enumerate(values[1:]):
                attended = attended + weights[..., length + j, None] * value
            attended = attended.transpose(1, 2).reshape(batch, length, heads * hd)  # (B, T, H*hd)
            features = self._finish(features, F.linear(attended, self.o_weight, self.o_bias))  # (B, T, D)
            outputs.append(features)
        return outputs


class Eagle3Head(nn.Module):
    """fc (kD -> D), the midlayer, ``norm`` and ``lm_head`` (D -> N) with ``d2t`` / ``t2d``.

    ``sizes``: the target block's shape (:func:`specdraft.heads.eagle.head_config`), ``aux_layers`` and
    ``draft_vocab_size``; ``draft_token_ids`` (N,), when given, sets d2t and t2d (else they come from the weights).
    """

    def __init__(self, sizes: dict, draft_token_ids: torch.Tensor | None = None, sampling: int = 0) -> None:
        super().__init__()
        self.sizes = dict(sizes)
        self.config = llama_config(sizes)
        hidden, vocab, draft = sizes["hidden_size"], sizes["vocab_size"], sizes["draft_vocab_size"]
        self.aux_layers = [int(i) for i in sizes["aux_layers"]]
        self.fc = nn.Linear(len(self.aux_layers) * hidden, hidden, bias=False)
        self.sampling = FeatureSampling(hidden, sampling) if sampling else None  # FSPAD (heads.fspad)
        nn.init.normal_(self.fc.weight, 0.0, 0.02)
        self.layer = Eagle3Layer(self.config)
        self.norm = nn.Parameter(torch.ones(hidden))
        self.lm_head = nn.Linear(hidden, draft, bias=False)
        nn.init.normal_(self.lm_head.weight, 0.0, 0.02)
        ids = torch.arange(draft) if draft_token_ids is None else torch.as_tensor(draft_token_ids, dtype=torch.long)
        if ids.shape != (draft,) or int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != draft:
            raise SpecdraftError(f"draft vocabulary must be {draft} distinct target token ids below {vocab}")
        ids = ids.sort().values
        self.register_buffer("d2t", ids - torch.arange(draft))  # (N,): target id = i + d2t[i]
        self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True))  # (V,)
        cos, sin = rope_table(self.config, torch.float32)
        self.register_buffer("rope_cos", cos, persistent=False)  # (P, hd/2)
        self.register_buffer("rope_sin", sin, persistent=False)  # (P, hd/2)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def draft_token_ids(self) -> torch.Tensor:
        """(N,) target ids of the draft vocabulary, increasing."""
        return self.d2t + torch.arange(self.d2t.shape[0], device=self.d2t.device)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """(..., kD) concatenated target features -> (..., D)."""
        return self.fc(aux.to(self.dtype))

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """(..., D) head outputs -> (..., N) draft-vocabulary logits."""
        normed = F.rms_norm(features, self.norm.shape, self.norm.to(features.dtype), self.layer.eps)
        return self.lm_head(normed)

    def new_cache(self, capacity: int, batch_size: int = 1, dtype: torch.dtype | None = None) -> StaticKVCache:
        config = self.config
        return StaticKVCache(1, batch_size, config.num_key_value_heads, capacity, config.head_dim,
                             dtype or self.dtype, self.fc.weight.device)

    def forward(self, features: torch.Tensor, embeds: torch.Tensor, cache: StaticKVCache,
                positions: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Draft step: pairs of (B, T, D) features (fused target features or the head's outputs) and embeddings of
        the next tokens, appended to ``cache`` (positions (T,) and mask (T, S) for a tree step, as
        :meth:`specdraft.heads.eagle.EagleHead.forward`). Returns (B, T, D) next features."""
        steps = features.shape[1]
        cache.ensure_room(steps)
        step = self._step(cache.length, steps, positions, attention_mask)
        features, embeds = features.to(self.dtype), embeds.to(self.dtype)
        if self.sampling is not None:
            features = self.sampling(features, embeds)  # (B, T, D): FSPAD's sampled features
        out = self.layer(embeds, features, cache, step)  # (B, T, D)
        cache.advance(steps)
        return out

    def unroll(self, aux: torch.Tensor, embeds: list[torch.Tensor]) -> list[torch.Tensor]:
        """Training-time test: (B, T, kD) target features and len(embeds) steps of (B, T, D) token embeddings
        (step i: x_{t+1+i}) -> the outputs (B, T, D) of every step."""
        length = aux.shape[1] + len(embeds)
        if length > self.rope_cos.shape[0]:
            raise SpecdraftError(f"EAGLE-3 training sequences must be shorter than {self.rope_cos.shape[0]}")
        cos, sin = self.rope_cos[:length].to(self.dtype), self.rope_sin[:length].to(self.dtype)
        return self.layer.unroll([e.to(self.dtype) for e in embeds], self.fuse(aux), cos, sin, self.sampling)

    def _step(self, start: int, steps: int, positions: torch.Tensor | None, mask: torch.Tensor | None) -> LayerStep:
        return step_layout(self, start, steps, positions, mask, "EAGLE-3")


def build_eagle3(spec: dict, draft_token_ids: torch.Tensor | None = None) -> Eagle3Head:
    """A fresh head from a spec (``heads.json``'s ``spec``); training settings ride along as ``train_settings``."""
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "max_position_embeddings", "attention_bias", "mlp_bias", "rope_theta",
            "aux_layers", "draft_vocab_size")
    try:
        head = Eagle3Head({key: spec[key] for key in keys}, draft_token_ids, int(spec.get("fspad_sampling", 0)))
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecdraftError(f"bad EAGLE-3 head spec: {exc!r}") from None
    head.train_settings = {k: v for k, v in spec.items() if k not in keys}
    return head


__all__ = ["Eagle3Head", "Eagle3Layer", "build_eagle3", "default_aux_layers"]
