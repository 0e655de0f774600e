"""A minimal native Llama (transformers' ``LlamaForCausalLM``) for batch-1 speculative decoding on CPU.

The fast path for the Llama family (SmolLM2 among them). Compared with transformers it fuses the q/k/v and
gate/up projections at load time, keeps a preallocated, position-indexed :class:`StaticKVCache` whose rollback
is free (``crop`` only moves the length; later writes overwrite stale slots, as in gpt-fast), and looks rotary
angles up in a table built once.

Attention: a prefill into an empty cache uses SDPA with ``is_causal=True``. Every later forward folds the query
heads that share a key/value head into the query-length axis, ``(B, K, G*T, hd)``, and attends the cached keys
directly with an explicit boolean mask; on this CPU (2 threads, context 256, 9/3 heads) that is faster than
``enable_gqa=True`` or expanding the key/value heads, in fp32 and bf16, at T=1 and T=5.

Weights load from an in-memory transformers model (:meth:`NativeLlama.from_hf`) or from a checkpoint folder
(:meth:`NativeLlama.from_pretrained`) without building a transformers model.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import specdraft.models.packed as packing
import specdraft.models.quantized as quantization
import specdraft.models.rowgemm as rowgemm
from specdraft.errors import SpecdraftError

_ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

# (native parameter name, [(checkpoint tensor name, expected shape), ...] concatenated along dim 0)
Layout = list[tuple[str, list[tuple[str, tuple[int, ...]]]]]


def _rope_parameters(config) -> dict:
    """The config's rotary settings (transformers 5 standardises old ``rope_scaling`` into this dict)."""
    return dict(getattr(config, "rope_parameters", None) or {})


def _unsupported_reason(config) -> str | None:
    """Why ``config`` cannot be served natively, or None when it can."""
    model_type = getattr(config, "model_type", None)
    if model_type != "llama":
        return f"model_type is {model_type!r}, not 'llama'"
    if config.hidden_act != "silu":
        return f"hidden_act {config.hidden_act!r} is not supported (only 'silu')"
    if config.num_attention_heads % config.num_key_value_heads:
        return "num_attention_heads is not a multiple of num_key_value_heads"
    rope = _rope_parameters(config)
    rope_type = rope.get("rope_type", "default")
    if rope_type not in _ROPE_TYPES:
        return f"rope_type {rope_type!r} is not supported (only {', '.join(_ROPE_TYPES)})"
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        return "partial_rotary_factor other than 1.0 is not supported"
    missing = [key for key in _LLAMA3_KEYS if rope_type == "llama3" and key not in rope]
    return f"llama3 rope_parameters lack {', '.join(missing)}" if missing else None


def supports(config) -> bool:
    """Whether a transformers config can be served by :class:`NativeLlama` (else use the transformers path)."""
    return _unsupported_reason(config) is None


def check_supported(config, source: str) -> None:
    reason = _unsupported_reason(config)
    if reason is not None:
        raise SpecdraftError(f"unsupported model {source}: {reason}")


def _llama3_scaled(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by ``factor``, a smooth blend in between."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(is_medium, blended, scaled)


def rope_table(config, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's rotary angles, each (max_context, hd/2), computed in fp32."""
    rope = _rope_parameters(config)
    dim = config.head_dim
    inv_freq = 1.0 / (rope.get("rope_theta", 10000.0) ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if rope.get("rope_type", "default") == "llama3":
        inv_freq = _llama3_scaled(inv_freq, rope)
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # (P, hd/2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in transformers' half-split layout: ``x * cos + rotate_half(x) * sin``.

    Args:
        x: (B, T, n, hd) queries or keys.
        cos, sin: (T, 1, hd/2) angles of the T positions.
    """
    x1, x2 = x.chunk(2, dim=-1)  # (B, T, n, hd/2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (B, T, n, hd)


class StaticKVCache:
    """Preallocated per-layer keys and values; position p of every layer lives in slot p.

    ``crop`` only moves :attr:`length`: rolled-back slots are overwritten by the next forward, so rollback of
    rejected draft tokens costs nothing. Tensors are allocated outside inference mode so that forwards under
    ``torch.no_grad()`` and under ``torch.inference_mode()`` can both write them.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (batch_size, num_kv_heads, capacity, head_dim)  # (B, K, S, hd)
        with torch.inference_mode(False):
            self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.batch_size = batch_size
        self._capacity = capacity
        self._length = 0

    @property
    def length(self) -> int:
        """Number of valid positions held."""
        return self._length

    @property
    def capacity(self) -> int:
        """Most positions this cache can hold."""
        return self._capacity

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` positions (free: nothing is copied or cleared)."""
        if not 0 <= length <= self._length:
            raise SpecdraftError(f"cannot crop a KV cache of length {self._length} to {length}")
        self._length = length

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s keys (rotated) and values of the valid positions, each (B, K, length, hd), views
        (:class:`~specdraft.models.base.ReadableKVCache`)."""
        if not -len(self.keys) <= layer < len(self.keys):
            raise SpecdraftError(f"layer {layer} out of range for a KV cache of {len(self.keys)} layers")
        return self.keys[layer][:, :, : self._length], self.values[layer][:, :, : self._length]

    def ensure_room(self, num_new: int) -> None:
        """Raise unless ``num_new`` more positions fit."""
        if self._length + num_new > self._capacity:
            raise SpecdraftError(
                f"KV cache capacity {self._capacity} exceeded: {self._length} positions held, {num_new} more given"
            )

    def write(
        self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one layer's new keys and values at positions ``start ..``; return that layer's keys and values so far.

        Args:
            keys, values: (B, T, K, hd) for positions ``start .. start + T - 1``.

        Returns:
            Keys and values, each (B, K, start + T, hd), views into the cache.
        """
        end = start + keys.shape[1]
        self.keys[layer][:, :, start:end].copy_(keys.transpose(1, 2))  # (B, K, T, hd)
        self.values[layer][:, :, start:end].copy_(values.transpose(1, 2))  # (B, K, T, hd)
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def compact(self, start: int, slots: list[int]) -> None:
        """Keep positions ``0 .. start - 1`` and move the given slots (each >= start, increasing) to ``start ..``;
        the length becomes ``start + len(slots)``. After tree verification this keeps the accepted path only."""
        if not 0 <= start <= self._length or any(not start <= s < self._length for s in slots):
            raise SpecdraftError(f"cannot compact a KV cache of length {self._length} to {start} + slots {slots}")
        if slots != list(range(start, start + len(slots))):
            index = torch.tensor(slots, dtype=torch.long, device=self.keys[0].device)
            end = start + len(slots)
            for tensors in (self.keys, self.values):
                for layer in tensors:
                    layer[:, :, start:end] = layer.index_select(2, index)  # (B, K, m, hd)
        self._length = start + len(slots)

    def advance(self, num_new: int) -> None:
        """Mark ``num_new`` more positions valid, once every layer has written them."""
        self.ensure_room(num_new)
        self._length += num_new

    def resized(self, capacity: int) -> StaticKVCache:
        """A cache of ``capacity`` positions (at least :attr:`length`) holding this one's valid positions, copied."""
        if capacity < self._length:
            raise SpecdraftError(f"cannot hold {self._length} positions in a KV cache of capacity {capacity}")
        batch, kv_heads, _, head_dim = self.keys[0].shape
        grown = StaticKVCache(len(self.keys), batch, kv_heads, capacity, head_dim, self.keys[0].dtype,
                              self.keys[0].device)
        for mine, theirs in ((self.keys, grown.keys), (self.values, grown.values)):
            for source, target in zip(mine, theirs, strict=True):
                target[:, :, : self._length].copy_(source[:, :, : self._length])  # (B, K, length, hd)
        grown.advance(self._length)
        return grown


@dataclass(frozen=True)
class LayerStep:
    """What every layer of one forward shares: where the new positions start, their angles, the mask."""

    start: int
    cos: torch.Tensor  # (T, 1, hd/2)
    sin: torch.Tensor  # (T, 1, hd/2)
    mask: torch.Tensor | None  # (G*T, start + T) bool (row-wise: at least its first T rows), or None when not needed
    explicit: bool = False  # the mask is given (tree step): never take the is_causal prefill path
    rowwise: bool = False  # attend each query on its own (rowgemm.attention): a k-token step = k 1-token steps
    chunks: tuple | None = None  # a long causal forward as row-wise steps: (begin, end, mask (end-begin, S)) each


def causal_mask(start: int, steps: int, groups: int, device: torch.device) -> torch.Tensor | None:
    """Causal mask for the folded queries: row ``g*T + t`` (position start + t) sees keys 0 .. start + t.

    None for a single query (it sees the whole cache) and for a prefill of an empty cache (``is_causal`` instead).
    """
    if steps == 1 or start == 0:
        return None
    # per group, row t keeps slots s <= start + t: a lower triangle shifted right by start (two ops, not six)
    mask = torch.ones(groups, steps, start + steps, dtype=torch.bool, device=device).tril_(start)  # (G, T, S)
    return mask.view(groups * steps, start + steps)  # (G*T, S)


def _attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step: LayerStep) -> torch.Tensor:
    """Grouped-query attention of new positions over the cache.

    Args:
        queries: (B, T, H, hd), rotated.
        keys, values: (B, K, start + T, hd), the cache so far including the new positions.

    Returns:
        (B, T, H*hd) attention output.
    """
    batch, steps, heads, head_dim = queries.shape
    if step.rowwise:
        return rowgemm.attention(queries, keys, values, None if step.mask is None else step.mask[:steps])
    if keys.dtype != queries.dtype:  # a cache in its own format (a quantized model's fp16 cache): widened exactly
        keys, values = keys.to(queries.dtype), values.to(queries.dtype)
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    if step.start == 0 and not step.explicit:
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2), keys, values, is_causal=True, enable_gqa=True
        )  # (B, H, T, hd)
        return out.transpose(1, 2).reshape(batch, steps, heads * head_dim)
    folded = queries.reshape(batch, steps, kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4)  # (B, K, G, T, hd)
    folded = folded.reshape(batch, kv_heads, groups * steps, head_dim)  # (B, K, G*T, hd)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=step.mask)  # (B, K, G*T, hd)
    out = out.reshape(batch, kv_heads, groups, steps, head_dim).permute(0, 3, 1, 2, 4)  # (B, T, K, G, hd)
    return out.reshape(batch, steps, heads * head_dim)


def _weight(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised, frozen parameter (weights are copied in at load time)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class DecoderLayer(nn.Module):
    """One pre-norm Llama block with fused q/k/v and gate/up projections."""

    def __init__(self, config, dtype: torch.dtype, dense: bool = True) -> None:
        """``dense`` False leaves the four weight matrices out: :attr:`quantized` holds them instead
        (:class:`specdraft.models.quantized_llama.QuantizedLlama`)."""
        super().__init__()
        hidden, head_dim, ffn = config.hidden_size, config.head_dim, config.intermediate_size
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = head_dim
        self.eps = config.rms_norm_eps
        qkv = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        sizes = {"qkv": (qkv, hidden), "o": (hidden, self.num_heads * head_dim), "gate_up": (2 * ffn, hidden),
                 "down": (hidden, ffn)}
        biased = {"qkv": config.attention_bias, "o": config.attention_bias, "gate_up": config.mlp_bias,
                  "down": config.mlp_bias}
        self.attn_norm = _weight(hidden, dtype=dtype)
        self.mlp_norm = _weight(hidden, dtype=dtype)
        for name, (rows, cols) in sizes.items():
            setattr(self, f"{name}_weight", _weight(rows, cols, dtype=dtype) if dense else None)
            setattr(self, f"{name}_bias", _weight(rows, dtype=dtype) if biased[name] else None)
        self.packed: dict[str, packing.PackedWeight] = {}  # name -> weight prepared once (NativeLlama.prepack)
        self.quantized: dict[str, quantization.QuantizedWeight] = {}  # name -> block-quantized weight (not dense)

    def prepack(self, kind: str | None = None) -> None:
        """Pack this layer's four weight matrices for this CPU's kernels (:mod:`specdraft.models.packed`)."""
        packed = {name: packing.pack(getattr(self, f"{name}_weight"), kind) for name in ("qkv", "o", "gate_up", "down")}
        self.packed = {name: weight for name, weight in packed.items() if weight is not None}

    def linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Projection ``name`` (qkv, o, gate_up or down) of x (..., in) -> (..., out), with its bias."""
        bias = getattr(self, f"{name}_bias")
        if self.quantized:
            out = quantization.linear(x, self.quantized[name])  # (..., out) fp32
            return out if bias is None else out + bias
        return packing.linear(x, getattr(self, f"{name}_weight"), bias, self.packed.get(name))

    def forward(self, hidden: torch.Tensor, cache: StaticKVCache, index: int, step: LayerStep) -> torch.Tensor:
        """(B, T, D) -> (B, T, D); writes this layer's keys and values for the new positions into ``cache``."""
        normed = F.rms_norm(hidden, self.attn_norm.shape, self.attn_norm, self.eps)  # (B, T, D)
        hidden = hidden + self._attention(normed, cache, index, step)
        normed = F.rms_norm(hidden, self.mlp_norm.shape, self.mlp_norm, self.eps)  # (B, T, D)
        return hidden + self._mlp(normed)

    def _attention(self, x: torch.Tensor, cache: StaticKVCache, index: int, step: LayerStep) -> torch.Tensor:
        batch, steps, _ = x.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.linear("qkv", x).view(batch, steps, -1, self.head_dim)  # (B, T, H+2K, hd)
        rotated = rotate(qkv[:, :, : heads + kv_heads], step.cos, step.sin)  # (B, T, H+K, hd)
        queries, new_keys = rotated.split((heads, kv_heads), dim=2)  # (B, T, H, hd), (B, T, K, hd)
        keys, values = cache.write(index, step.start, new_keys, qkv[:, :, heads + kv_heads :])  # (B, K, S, hd)
        return self.linear("o", _attend(queries, keys, values, step))  # (B, T, D)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear("gate_up", x).chunk(2, dim=-1)  # (B, T, F) each
        return self.linear("down", F.silu(gate) * up)  # (B, T, D)


def _layer_layout(config, index: int) -> Layout:
    """Checkpoint tensors behind layer ``index``'s native parameters."""
    hidden, head_dim, ffn = config.hidden_size, config.head_dim, config.intermediate_size
    q_rows, kv_rows = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    native, attn, mlp = f"layers.{index}.", f"model.layers.{index}.self_attn.", f"model.layers.{index}.mlp."
    qkv = [(f"{attn}q_proj", q_rows), (f"{attn}k_proj", kv_rows), (f"{attn}v_proj", kv_rows)]
    gate_up = [(f"{mlp}gate_proj", ffn), (f"{mlp}up_proj", ffn)]
    layout = [
        (f"{native}attn_norm", [(f"model.layers.{index}.input_layernorm.weight", (hidden,))]),
        (f"{native}qkv_weight", [(f"{name}.weight", (rows, hidden)) for name, rows in qkv]),
        (f"{native}o_weight", [(f"{attn}o_proj.weight", (hidden, q_rows))]),
        (f"{native}mlp_norm", [(f"model.layers.{index}.post_attention_layernorm.weight", (hidden,))]),
        (f"{native}gate_up_weight", [(f"{name}.weight", (rows, hidden)) for name, rows in gate_up]),
        (f"{native}down_weight", [(f"{mlp}down_proj.weight", (hidden, ffn))]),
    ]
    if config.attention_bias:
        layout.append((f"{native}qkv_bias", [(f"{name}.bias", (rows,)) for name, rows in qkv]))
        layout.append((f"{native}o_bias", [(f"{attn}o_proj.bias", (hidden,))]))
    if config.mlp_bias:
        layout.append((f"{native}gate_up_bias", [(f"{name}.bias", (rows,)) for name, rows in gate_up]))
        layout.append((f"{native}down_bias", [(f"{mlp}down_proj.bias", (hidden,))]))
    return layout


def _checkpoint_layout(config) -> Layout:
    """Every native parameter and the transformers checkpoint tensors it is concatenated from."""
    embed = (config.vocab_size, config.hidden_size)
    layout = [
        ("embed_weight", [("model.embed_tokens.weight", embed)]),
        ("norm_weight", [("model.norm.weight", (config.hidden_size,))]),
    ]
    if not config.tie_word_embeddings:
        layout.append(("lm_head_weight", [("lm_head.weight", embed)]))
    for index in range(config.num_hidden_layers):
        layout.extend(_layer_layout(config, index))
    return layout


def _fetch(tensors: dict[str, torch.Tensor], key: str, shape: tuple[int, ...], source: str) -> torch.Tensor:
    if key not in tensors:
        raise SpecdraftError(f"corrupt checkpoint {source}: missing tensor {key}")
    if tuple(tensors[key].shape) != shape:
        raise SpecdraftError(
            f"corrupt checkpoint {source}: tensor {key} has shape {tuple(tensors[key].shape)}, config expects {shape}"
        )
    return tensors[key]


class NativeLlama(nn.Module):
    """Llama causal LM implementing :class:`specdraft.models.base.CausalLM` with a :class:`StaticKVCache`.

    Build it with :meth:`from_pretrained` or :meth:`from_hf`; the constructor leaves weights uninitialised.
    Move it with the constructors' ``dtype`` argument, not ``.to()``, so that :attr:`dtype` stays true.
    """

    def __init__(self, config, dtype: torch.dtype = torch.float32, name: str = "llama") -> None:
        super().__init__()
        check_supported(config, name)
        self.config = config
        self.name = name
        self.dtype = dtype
        self.vocab_size = config.vocab_size
        self.max_context = config.max_position_embeddings
        self.eps = config.rms_norm_eps
        self.embed_weight = _weight(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype) for _ in range(config.num_hidden_layers))
        self.norm_weight = _weight(config.hidden_size, dtype=dtype)
        tied = config.tie_word_embeddings
        self.lm_head_weight = self.embed_weight if tied else _weight(config.vocab_size, config.hidden_size, dtype=dtype)
        cos, sin = rope_table(config, dtype)
        self.register_buffer("rope_cos", cos, persistent=False)  # (P, hd/2)
        self.register_buffer("rope_sin", sin, persistent=False)  # (P, hd/2)
        self.packed_head: packing.PackedWeight | None = None  # the LM head prepared once (prepack)
        self.eval()

    def prepack(self, kind: str | None = None) -> bool:
        """Pack every linear weight once for this CPU's fastest kernel (:mod:`specdraft.models.packed`): k-token
        forwards then cost far less than k 1-token ones. Weights must not change afterwards (call it again if they
        do). ``kind`` (``rows`` or ``onednn``) asks for one path, for comparisons. Returns whether anything was
        packed (False where this dtype cannot be packed so on this CPU)."""
        for layer in self.layers:
            layer.prepack(kind)
        self.packed_head = packing.pack(self.lm_head_weight, kind)
        named = [(layer, name) for layer in self.layers for name in layer.packed]
        *moved, self.packed_head = packing.in_huge_pages([layer.packed[n] for layer, n in named] + [self.packed_head])
        for (layer, name), weight in zip(named, moved, strict=True):  # a step streams them all: 2 MiB pages
            layer.packed[name] = weight
        return self.packed_head is not None or any(layer.packed for layer in self.layers)

    @property
    def packing(self) -> str:
        """How the linears are packed: ``rows``, ``onednn`` (:mod:`specdraft.models.packed`) or ``none``."""
        head = self.packed_head or next((p for layer in self.layers for p in layer.packed.values()), None)
        return "none" if head is None else head.kind

    @property
    def parameter_count(self) -> int:
        """Weights of the model (a tied table counted once)."""
        return sum(p.numel() for p in self.parameters())

    @classmethod
    def from_hf(cls, model, dtype: torch.dtype | None = None) -> NativeLlama:
        """Copy the weights of an in-memory transformers ``LlamaForCausalLM`` (in its dtype unless given)."""
        config = model.config
        name = getattr(config, "_name_or_path", "") or "llama"
        native = cls(config, dtype=dtype or model.dtype, name=name)
        native.load_checkpoint_tensors(model.state_dict(), source=f"transformers model {name}")
        return native

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype = torch.float32, name: str | None = None,
        extra_tensors: dict[str, torch.Tensor] | None = None,
    ) -> NativeLlama:
        """Load a transformers-format checkpoint folder (``config.json`` and safetensors weights), plus
        ``extra_tensors`` (transformers names) that the folder does not store, e.g. shared embeddings."""
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise SpecdraftError(f"checkpoint folder not found: {folder}")
        config = read_config(folder)
        check_supported(config, str(folder))
        native = cls(config, dtype=dtype, name=name or folder.name)
        native.load_checkpoint_tensors(_read_weights(folder) | (extra_tensors or {}), source=str(folder))
        return native

    @torch.no_grad()
    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        """Copy transformers-named tensors into the fused parameters, checking names and shapes against the config."""
        parameters = dict(self.named_parameters(remove_duplicate=False))
        for native_name, parts in _checkpoint_layout(self.config):
            pieces = [_fetch(tensors, key, shape, source) for key, shape in parts]
            parameters[native_name].copy_(torch.cat(pieces) if len(pieces) > 1 else pieces[0])

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The weights under their transformers names (the inverse of :meth:`load_checkpoint_tensors`): fused
        parameters are split back into views of their pieces."""
        parameters = dict(self.named_parameters(remove_duplicate=False))
        tensors: dict[str, torch.Tensor] = {}
        for native_name, parts in _checkpoint_layout(self.config):
            pieces = parameters[native_name].detach().split([shape[0] for _, shape in parts])
            tensors.update((key, piece) for (key, _), piece in zip(parts, pieces, strict=True))
        return tensors

    def new_cache(self, capacity: int, batch_size: int = 1) -> StaticKVCache:
        """An empty cache for up to ``capacity`` positions (at most :attr:`max_context`)."""
        if not 1 <= capacity <= self.max_context:
            raise SpecdraftError(f"KV cache capacity must be in 1 .. {self.max_context}, got {capacity}")
        if batch_size < 1:
            raise SpecdraftError(f"batch size must be at least 1, got {batch_size}")
        config = self.config
        return StaticKVCache(
            config.num_hidden_layers,
            batch_size,
            config.num_key_value_heads,
            capacity,
            config.head_dim,
            self.cache_dtype,
            self.rope_cos.device,  # (a quantized model has no dense table to ask)
        )

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype :meth:`new_cache` holds keys and values in: the model's."""
        return self.dtype

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: StaticKVCache,
        positions: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        layers: Sequence[int] | None = None,
        return_hidden: bool = False,
        logits_weight: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        hidden_layers: Sequence[int] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits for ``input_ids`` (B, T) written to cache slots ``cache.length ..``; returns (B, T, V) float32.

        By default token t sits at position ``cache.length + t`` and attends causally. For a token tree give
        ``positions`` (T,) absolute positions and ``attention_mask`` (T, T) bool among the new tokens (every cached
        slot stays visible to all of them), or (T, cache.length + T) over every slot; slots then differ from
        positions until :meth:`StaticKVCache.compact`. ``layers`` (increasing indices) runs only those decoder
        layers; the skipped layers' slots for the new positions are left unwritten (layer-skip self-speculative
        drafting crops them afterwards). ``return_hidden`` also returns the final-normed hidden states (B, T, D),
        the LM head's input (the features Medusa and EAGLE heads read). ``logits_weight`` (N, D) replaces the LM
        head, e.g. its rows of a draft vocabulary (:mod:`specdraft.draft_vocab`); logits are then (B, T, N).
        ``logits_to_keep`` = k > 0 applies the head to the last k positions only, (B, k, V): a long prompt's
        prefill otherwise spends a fifth of its work (SmolLM2's 49k x 576 head) on logits nobody reads.
        ``hidden_layers`` (increasing layer indices, with ``return_hidden``) returns instead the residual stream
        entering those layers, concatenated: (B, T, k*D) (EAGLE-3's low, middle and high features).
        """
        if input_ids.dim() != 2 or input_ids.shape[1] == 0 or input_ids.shape[0] != cache.batch_size:
            raise SpecdraftError(
                f"input_ids must be (batch {cache.batch_size}, T >= 1) to match the cache, got {tuple(input_ids.shape)}"
            )
        steps = input_ids.shape[1]
        cache.ensure_room(steps)
        if positions is None and attention_mask is None:
            step = self._step(cache.length, steps)
        else:
            step = self._tree_step(cache.length, steps, positions, attention_mask)
        hidden = self.embed_tokens(input_ids)  # (B, T, D)
        aux: list[torch.Tensor] = []
        if hidden_layers is not None:
            if layers is not None:
                raise SpecdraftError("hidden_layers cannot be combined with a layer subset")
            hidden = self._run_layers(hidden, cache, step, self._check_layers(hidden_layers), aux)
        elif layers is None:
            hidden = self._run_layers(hidden, cache, step)
        else:
            hidden = self._run_layer_subset(hidden, cache, step, self._check_layers(layers))
        cache.advance(steps)
        hidden = self.final_norm(hidden)  # (B, T, D)
        rows = hidden[:, -logits_to_keep:] if logits_to_keep > 0 else hidden  # (B, k, D) or (B, T, D)
        logits = self.lm_head(rows, logits_weight)  # (B, T or k, V) or (B, T or k, N)
        if aux:
            hidden = torch.cat(aux, dim=-1)  # (B, T, k*D)
        return (logits, hidden) if return_hidden else logits

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The norm before the LM head: (..., D) -> (..., D)."""
        return F.rms_norm(hidden, self.norm_weight.shape, self.norm_weight, self.eps)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: ids (...) -> (..., D) in the model's dtype."""
        return F.embedding(input_ids, self.embed_weight)

    def lm_head(self, rows: torch.Tensor, logits_weight: torch.Tensor | None = None, prepacked: bool = True
                ) -> torch.Tensor:
        """Logits (..., V) float32 of final-normed hidden states (..., D); ``logits_weight`` (N, D) replaces the head
        (then (..., N)). ``prepacked`` False multiplies with ``F.linear`` (the batched forward's products)."""
        weight = self.lm_head_weight if logits_weight is None else logits_weight
        head = self.packed_head if logits_weight is None and prepacked else None
        return packing.linear(rows, weight, None, head).float()

    def _step(self, start: int, steps: int) -> LayerStep:
        groups = self.config.num_attention_heads // self.config.num_key_value_heads
        cos = self.rope_cos[start : start + steps].unsqueeze(1)  # (T, 1, hd/2)
        sin = self.rope_sin[start : start + steps].unsqueeze(1)  # (T, 1, hd/2)
        rowwise = start > 0 and self._rowwise(steps)  # row-wise attention reads one group's rows: (T, S)
        return LayerStep(start, cos, sin, causal_mask(start, steps, 1 if rowwise else groups, cos.device),
                         rowwise=rowwise)

    def _tree_step(
        self, start: int, steps: int, positions: torch.Tensor | None, attention_mask: torch.Tensor | None
    ) -> LayerStep:
        """A step with explicit positions and a mask among the new tokens (token-tree verification) or over every
        slot (layer-skip calibration)."""
        device = self.rope_cos.device
        if positions is None:
            positions = start + torch.arange(steps, device=device)
        if attention_mask is None:
            attention_mask = torch.ones(steps, steps, dtype=torch.bool, device=device).tril()
        full = attention_mask.shape == (steps, start + steps)  # a mask over every slot, cached ones included
        if positions.shape != (steps,) or not (full or attention_mask.shape == (steps, steps)):
            raise SpecdraftError(
                f"tree positions must be ({steps},) and attention_mask ({steps}, {steps}) or ({steps}, {start + steps})"
            )
        if int(positions.min()) < 0 or int(positions.max()) >= self.max_context:
            raise SpecdraftError(f"positions must lie in 0 .. {self.max_context - 1}")
        groups = self.config.num_attention_heads // self.config.num_key_value_heads
        cos = self.rope_cos[positions].unsqueeze(1)  # (T, 1, hd/2)
        sin = self.rope_sin[positions].unsqueeze(1)  # (T, 1, hd/2)
        if full:
            seen = attention_mask.to(device)  # (T, S)
        else:
            seen = torch.ones(steps, start + steps, dtype=torch.bool, device=device)  # (T, S): all cached slots
            seen[:, start:] = attention_mask.to(device)
        rowwise = self._rowwise(steps)  # row-wise attention reads one group's rows: (T, S)
        return LayerStep(start, cos, sin, seen if rowwise else seen.repeat(groups, 1), explicit=True, rowwise=rowwise)

    def _rowwise(self, steps: int) -> bool:
        """Whether a forward of ``steps`` new tokens after a prefill attends row-invariantly: with the row-invariant
        linears (``rows`` packing) and up to ``packing.ROWS_MAX`` tokens (a long prompt keeps SDPA)."""
        head_dim = self.config.hidden_size // self.config.num_attention_heads
        return steps <= packing.ROWS_MAX and getattr(self.config, "head_dim", head_dim) % 8 == 0 \
            and self.packing == "rows"

    def _run_layers(self, hidden: torch.Tensor, cache: StaticKVCache, step: LayerStep, taps: Sequence[int] = (),
                    aux: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The decoder stack, layer by layer; each layer owns cache slot ``index``. The input of each layer in
        ``taps`` is appended to ``aux``."""
        for index, layer in enumerate(self.layers):
            if index in taps:
                aux.append(hidden)  # (B, T, D)
            hidden = layer(hidden, cache, index, step)  # (B, T, D)
        return hidden

    def _run_layer_subset(
        self, hidden: torch.Tensor, cache: StaticKVCache, step: LayerStep, layers: list[int]
    ) -> torch.Tensor:
        """Only the decoder layers ``layers``; each still owns its own cache slot ``index``."""
        for index in layers:
            hidden = self.layers[index](hidden, cache, index, step)  # (B, T, D)
        return hidden

    def _check_layers(self, layers: Sequence[int]) -> list[int]:
        kept = [int(index) for index in layers]
        count = len(self.layers)
        if not kept or any(not 0 <= i < count for i in kept) or any(a >= b for a, b in itertools.pairwise(kept)):
            raise SpecdraftError(f"layers must be increasing indices in 0 .. {count - 1}, at least one, got {kept}")
        return kept


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def read_config(folder: Path):
    """The folder's transformers config (any architecture: the caller checks it is Llama)."""
    from transformers import AutoConfig

    if not (folder / "config.json").is_file():
        raise SpecdraftError(f"corrupt checkpoint {folder}: no config.json")
    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise SpecdraftError(f"corrupt checkpoint {folder}: unreadable config.json ({_first_line(exc)})") from None


def _load_safetensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not file.is_file():
        raise SpecdraftError(f"corrupt checkpoint {file.parent}: missing weights file {file.name}")
    try:
        return load_file(file)
    except (SafetensorError, OSError) as exc:
        raise SpecdraftError(f"corrupt checkpoint {file}: {_first_line(exc)}") from None


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors``, or of every shard named by ``model.safetensors.index.json``."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return _load_safetensors(single)
    if not index.is_file():
        raise SpecdraftError(f"corrupt checkpoint {folder}: no model.safetensors or model.safetensors.index.json")
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SpecdraftError(f"corrupt checkpoint {index}: unreadable index ({_first_line(exc)})") from None
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors.update(_load_safetensors(folder / shard))
    return tensors
