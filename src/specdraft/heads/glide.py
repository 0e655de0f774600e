"""The GliDe draft model (Du et al. 2024, "GliDe with a CaPE: A Low-Hassle Method to Accelerate Speculative
Decoding", arXiv 2402.02082, Sec. 3): a few decoder blocks whose layers also cross-attend to the keys and values the
frozen target already cached for the context ("glimpse"), so the draft reads what the target computed at no extra
target cost.

Block l (a pre-norm Llama block with a cross-attention sub-layer inserted between self-attention and the MLP, where
GliDe puts it):

    h = h + SelfAttn(rms(h))                    over the draft's own cache: committed tokens, then the draft path
    h = h + CrossAttn(rms(h); K_T, V_T)          queries W_q rms(h), rotated at the token's position; keys and values:
                                                  the target's cache of layer ``glimpse_layer`` (default its last)
    h = h + MLP(rms(h))
    q(x_{p+1}) = softmax(W_lm norm(h_p))         E (input) and W_lm are the target's, frozen and never stored

The target's cached keys already carry their rotary angles (at their positions), so the query is rotated at its own
position and the score depends on the distance, as in the target's own attention. The cross-attention has the
target's query and key/value head counts (grouped-query attention over the cached heads).

Glimpse rule. A token fed at position p as part of the context reads the target's keys of positions < p; a draft
node of a step whose root (the last context token) is at position r reads those of positions < r: when the drafter
runs, the verify forward of the last step has written every context token but the root, and no draft token. A
position with nothing to read (the first one) gets a zero cross-attention output.

Training (``specdraft train-heads --kind glide``, :mod:`specdraft.training.heads.glide`) teaches every depth of the
chain from every root at once, exactly as drafting sees it (the training-time test of EAGLE-3, Li et al. 2025): step 0
feeds the sequence as context; step i feeds, for every root t, the token x_{t+i} at position t + i, which attends
the step-0 slots <= t, the slots of steps 1..i at root t (its ancestors and itself), and the target's keys < t.
Since the inputs are tokens, all steps go through one forward over the concatenated steps with that mask
(:func:`unroll_layout`). GliDe's paper trains the draft on the target's outputs; the unroll's glimpse masks here are
this implementation's, not a copy of the paper's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.heads.eagle import head_config, llama_config, step_layout
from specdraft.models.native_llama import DecoderLayer, LayerStep, StaticKVCache, rope_table, rotate

OPTIONS = {"layers": "1", "glimpse_layer": "-1", "ttt_steps": "3", "decay": "0.8"}


def cross_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    visible: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention of draft queries over the target's cached keys and values.

    Args:
        queries: (B, T, H, hd), rotated.
        keys, values: (B, K, S, hd), the target's cache (keys rotated); S may be 0.
        visible: (T, S) bool, which cached positions each query reads.

    Returns:
        (B, T, H*hd); zero for a query that reads nothing.
    """
    batch, steps, heads, head_dim = queries.shape
    kv_heads, size = keys.shape[1], keys.shape[2]
    out = queries.new_zeros(batch, steps, heads * head_dim)
    if size == 0:
        return out
    groups = heads // kv_heads
    some = visible.any(-1)  # (T,)
    mask = visible.clone()
    mask[~some, 0] = True  # a row must see something; its output is zeroed below
    folded = queries.reshape(batch, steps, kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4)  # (B, K, G, T, hd)
    folded = folded.reshape(batch, kv_heads, groups * steps, head_dim)  # (B, K, G*T, hd)
    attended = F.scaled_dot_product_attention(folded, keys.to(folded.dtype), values.to(folded.dtype),
                                              attn_mask=mask.repeat(groups, 1))  # (B, K, G*T, hd)
    attended = attended.reshape(batch, kv_heads, groups, steps, head_dim).permute(0, 3, 1, 2, 4)  # (B, T, K, G, hd)
    return attended.reshape(batch, steps, heads * head_dim) * some[None, :, None].to(attended.dtype)


class GlideLayer(DecoderLayer):
    """A native Llama block (self-attention on the draft's cache, MLP) plus GliDe's cross-attention (``cross_norm``,
    ``cross_q_weight`` (H*hd, D), ``cross_o_weight`` (D, H*hd)), all trainable."""

    def __init__(self, config) -> None:
        super().__init__(config, torch.float32)
        hidden, width = config.hidden_size, config.num_attention_heads * config.head_dim
        self.cross_norm = nn.Parameter(torch.ones(hidden))
        self.cross_q_weight = nn.Parameter(torch.empty(width, hidden))
        self.cross_o_weight = nn.Parameter(torch.empty(hidden, width))
        for name, parameter in self.named_parameters():
            parameter.requires_grad_(True)
            with torch.no_grad():
                parameter.fill_(1.0) if name.endswith("norm") else parameter.normal_(0.0, 0.02)
                if name.endswith("bias"):
                    parameter.zero_()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight.to(x.dtype), self.eps)

    def forward(self, hidden: torch.Tensor, cache: StaticKVCache, index: int, step: LayerStep,
                glimpse: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """(B, T, D) -> (B, T, D); writes this layer's keys and values into ``cache``. ``glimpse``: the target's
        keys and values (B, K, S, hd) and the (T, S) bool mask of what each new token reads."""
        hidden = hidden + self._attention(self._norm(hidden, self.attn_norm), cache, index, step)
        hidden = hidden + self._cross(self._norm(hidden, self.cross_norm), step, *glimpse)
        return hidden + self._mlp(self._norm(hidden, self.mlp_norm))

    def _cross(self, x: torch.Tensor, step: LayerStep, keys: torch.Tensor, values: torch.Tensor,
               visible: torch.Tensor) -> torch.Tensor:
        batch, steps, _ = x.shape
        queries = F.linear(x, self.cross_q_weight.to(x.dtype)).view(batch, steps, self.num_heads, self.head_dim)
        queries = rotate(queries, step.cos, step.sin)  # (B, T, H, hd) at the tokens' positions
        return F.linear(cross_attention(queries, keys, values, visible), self.cross_o_weight.to(x.dtype))


class GlideHead(nn.Module):
    """``layers`` GliDe blocks and a final norm over the target's frozen embeddings and LM head.

    ``sizes``: the target block's shape (:func:`specdraft.heads.eagle.head_config`) plus ``num_layers`` (draft
    blocks), ``glimpse_layer`` (the target layer whose cache is read, >= 0) and ``target_layers``.
    """

    def __init__(self, sizes: dict) -> None:
        super().__init__()
        self.sizes = dict(sizes)
        self.config = llama_config(sizes)
        self.glimpse_layer = int(sizes["glimpse_layer"])
        self.layers = nn.ModuleList(GlideLayer(self.config) for _ in range(int(sizes["num_layers"])))
        self.norm = nn.Parameter(torch.ones(sizes["hidden_size"]))
        cos, sin = rope_table(self.config, torch.float32)
        self.register_buffer("rope_cos", cos, persistent=False)  # (P, hd/2)
        self.register_buffer("rope_sin", sin, persistent=False)  # (P, hd/2)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    def new_cache(self, capacity: int, batch_size: int = 1, dtype: torch.dtype | None = None) -> StaticKVCache:
        """An empty cache of the draft's own keys and values, ``capacity`` slots."""
        config = self.config
        return StaticKVCache(len(self.layers), batch_size, config.num_key_value_heads, capacity, config.head_dim,
                             dtype or self.dtype, self.norm.device)

    def forward(self, embeds: torch.Tensor, target_kv: tuple[torch.Tensor, torch.Tensor], visible: torch.Tensor,
                cache: StaticKVCache | None = None, positions: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states (B, T, D) of tokens whose embeddings are ``embeds`` (B, T, D), appended to
        ``cache`` (None: a fresh one, as in training).

        Args:
            target_kv: the target's cached keys and values of ``glimpse_layer``, each (B, K, S, hd).
            visible: (T, S) bool, the target positions each token reads (the glimpse rule, module docstring).
            positions, attention_mask: (T,) rotary positions and (T, cache.length + T) bool over every slot, for
                a tree or an unroll (default: the slots, causal).
        """
        batch, steps = embeds.shape[:2]
        if cache is None:
            device = embeds.device.type
            autocast = torch.is_autocast_enabled(device)
            cache = self.new_cache(steps, batch, torch.get_autocast_dtype(device) if autocast else self.dtype)
        if visible.shape != (steps, target_kv[0].shape[2]):
            raise SpecdraftError(f"GliDe glimpse mask must be ({steps}, {target_kv[0].shape[2]}), "
                                 f"got {tuple(visible.shape)}")
        cache.ensure_room(steps)
        step = step_layout(self, cache.length, steps, positions, attention_mask, "GliDe")
        hidden = embeds.to(self.dtype)  # (B, T, D)
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, cache, index, step, (*target_kv, visible))  # (B, T, D)
        cache.advance(steps)
        return F.rms_norm(hidden, self.norm.shape, self.norm.to(hidden.dtype), self.config.rms_norm_eps)


def glimpse_mask(anchors: torch.Tensor, size: int) -> torch.Tensor:
    """(T, S) bool: token i reads the target's cached positions < ``anchors[i]`` (its own position for a context
    token, its step's root for a draft node) among ``size`` cached positions."""
    return torch.arange(size, device=anchors.device)[None, :] < anchors[:, None]


def unroll_layout(length: int, steps: int, device: torch.device | str = "cpu"
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions, self-attention mask and glimpse anchors of the training unroll over ``steps`` steps of a sequence
    of ``length`` tokens (module docstring): slot i*T + t is step i at root t, token x_{t+i}.

    Returns:
        positions (S*T,) = t + i; mask (S*T, S*T) bool; anchors (S*T,) = t (the glimpse reads positions < t).
    """
    roots = torch.arange(length, device=device)  # (T,)
    step = torch.arange(steps, device=device).repeat_interleave(length)  # (S*T,)
    root = roots.repeat(steps)  # (S*T,)
    causal = roots[None, :] <= roots[:, None]  # (T, T): step-0 slots <= t
    mask = torch.zeros(steps * length, steps * length, dtype=torch.bool, device=device)
    mask[:, :length] = causal.repeat(steps, 1)
    same_root = root[:, None] == root[None, :]  # (S*T, S*T)
    earlier = (step[None, :] <= step[:, None]) & (step[None, :] >= 1)  # steps 1..i
    mask |= same_root & earlier
    return root + step, mask, root


def unroll(head: GlideHead, embeds: torch.Tensor, target_kv: tuple[torch.Tensor, torch.Tensor],
           steps: int) -> list[torch.Tensor]:
    """Every step of the training unroll: ``embeds`` (B, L, D) of the sequence, ``target_kv`` the target's cache of
    the same sequence ((B, K, L, hd) each). Returns ``steps`` hidden states (B, L, D); step i at root t predicts
    x_{t+i+1} (its input x_{t+i} reads zero past the end)."""
    length = embeds.shape[1]
    if length + steps > head.rope_cos.shape[0]:
        raise SpecdraftError(f"GliDe training sequences must be shorter than {head.rope_cos.shape[0] - steps}")
    positions, mask, anchors = unroll_layout(length, steps, embeds.device)
    shifted = [embeds] + [torch.cat([embeds[:, i:], embeds.new_zeros(embeds.shape[0], i, embeds.shape[2])], dim=1)
                          for i in range(1, steps)]
    out = head(torch.cat(shifted, dim=1), target_kv, glimpse_mask(anchors, target_kv[0].shape[2]),
               positions=positions, attention_mask=mask)  # (B, S*L, D)
    return list(out.split(length, dim=1))


def num_parameters(head: GlideHead) -> int:
    """Trainable parameters (the target's embeddings, LM head and cache are read, not stored)."""
    return sum(p.numel() for p in head.parameters() if p.requires_grad)


def glide_spec(target_config, options: dict[str, str]) -> dict:
    """Sizes from the target's transformers config and the options of ``--kind glide``: ``layers`` (draft blocks,
    default 1), ``glimpse_layer`` (the target layer whose cache is read, default -1: the last), ``ttt_steps`` (depths
    trained from every root, default 3) and ``decay`` (weight decay^i of depth i's loss, default 0.8)."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise SpecdraftError(f"unknown glide option {', '.join(unknown)}; glide takes: {', '.join(OPTIONS)}")
    raw = OPTIONS | options
    try:
        layers, glimpse, steps, decay = (int(raw["layers"]), int(raw["glimpse_layer"]), int(raw["ttt_steps"]),
                                         float(raw["decay"]))
    except ValueError:
        raise SpecdraftError(f"glide options layers, glimpse_layer and ttt_steps need integers, decay a number: "
                             f"{options}") from None
    count = int(target_config.num_hidden_layers)
    if layers < 1 or steps < 1 or not 0 < decay <= 1 or not -count <= glimpse < count:
        raise SpecdraftError(f"glide needs layers >= 1, ttt_steps >= 1, 0 < decay <= 1 and glimpse_layer in "
                             f"{-count} .. {count - 1}: {options}")
    return head_config(target_config) | {"num_layers": layers, "glimpse_layer": glimpse % count,
                                          "target_layers": count, "ttt_steps": steps, "decay": decay}


def build_glide(spec: dict) -> GlideHead:
    """A fresh head from a spec (``heads.json``'s ``spec``); the training settings ride along as attributes."""
    try:
        head = GlideHead(spec)
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecdraftError(f"bad GliDe head spec: {exc!r}") from None
    head.train_settings = {"ttt_steps": int(spec.get("ttt_steps", 3)), "decay": float(spec.get("decay", 0.8))}
    return head


__all__ = ["GlideHead", "GlideLayer", "build_glide", "cross_attention", "glide_spec", "glimpse_mask", "unroll",
           "unroll_layout"]
