"""Ragged batched forwards of :class:`~specdraft.models.native_llama.NativeLlama` for batched speculative decoding.

Every row of a :class:`BatchedKVCache` is one sequence with its own length: one forward feeds row i ``T_i`` new
tokens (its uncached context tail, then its draft chain or tree), right-padded to a common T. Token t of row i is
written to slot ``length_i + t`` and sits at position ``length_i + offsets[i, t]``; it attends every cached slot of
its row and the new tokens its local mask allows (causal by default, a tree mask for a token tree). Padding tokens
attend causally too (never an empty row, which would put NaN into slots later masked by a zero weight), and nothing
real ever attends a padding slot, so a row's result is that of its batch-1 forward.

Rows are kept dense: the ``active`` sequences are rows 0 .. n-1, so every layer attends a view of the cache, not a
gathered copy; a sequence that leaves is replaced by the last row (:meth:`BatchedKVCache.move_row`). Rollback is
free as in the batch-1 static cache: a row's length moves back, stale slots are overwritten later.

A block-quantized model's layers run as fused calls over every row (:func:`~specdraft.models.quantized.
fused_layer_rows`), in chunks of up to ROWS_MAX tokens: each token's arithmetic is that of a batch-1 1-token step,
so a row's logits and cache are those of its batch-1 decoding bit for bit, whatever else shares the batch (a
server's answer to a request equals ``specdraft generate``'s). Dense models take the layer's own ops.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

import specdraft.models.packed as packing
from specdraft.errors import SpecdraftError
from specdraft.models import quantized, rowgemm


class BatchedKVCache:
    """Preallocated keys and values for ``max_rows`` sequences of up to ``capacity`` positions, with per-row lengths.

    Tensors are allocated outside inference mode so that forwards in either mode can write them.
    """

    def __init__(self, num_layers: int, max_rows: int, num_kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        shape = (max_rows, num_kv_heads, capacity, head_dim)  # (R, K, S, hd)
        with torch.inference_mode(False):
            self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_rows, self.capacity = max_rows, capacity
        self.lengths = [0] * max_rows  # valid positions of every row
        self._slots: torch.Tensor | None = None  # (n, T) slots the forward in progress writes
        self._rows: torch.Tensor | None = None  # (n, 1) rows it writes
        self._end = 0  # slots every row of the forward attends: max length + T

    def crop(self, row: int, length: int) -> None:
        """Keep only the first ``length`` positions of ``row`` (free: nothing is copied)."""
        if not 0 <= length <= self.lengths[row]:
            raise SpecdraftError(f"cannot crop row {row} of length {self.lengths[row]} to {length}")
        self.lengths[row] = length

    def compact(self, row: int, start: int, slots: list[int]) -> None:
        """Keep positions ``0 .. start - 1`` of ``row`` and move the given slots (each >= start, increasing) after
        them: after tree verification, only the accepted path stays."""
        if not 0 <= start <= self.lengths[row] or any(not start <= s < self.lengths[row] for s in slots):
            raise SpecdraftError(f"cannot compact row {row} of length {self.lengths[row]} to {start} + {slots}")
        if slots != list(range(start, start + len(slots))):
            index = torch.tensor(slots, dtype=torch.long, device=self.keys[0].device)
            for tensors in (self.keys, self.values):
                for layer in tensors:
                    layer[row, :, start : start + len(slots)] = layer[row].index_select(1, index)  # (K, m, hd)
        self.lengths[row] = start + len(slots)

    def move_row(self, source: int, target: int) -> None:
        """Copy row ``source`` (its valid positions) into row ``target``; ``source`` becomes empty."""
        if source != target:
            length = self.lengths[source]
            for tensors in (self.keys, self.values):
                for layer in tensors:
                    layer[target, :, :length] = layer[source, :, :length]
            self.lengths[target] = length
        self.lengths[source] = 0

    def swap_rows(self, a: int, b: int) -> None:
        """Exchange rows ``a`` and ``b`` (their valid positions and lengths)."""
        if a == b:
            return
        length_a, length_b = self.lengths[a], self.lengths[b]
        for tensors in (self.keys, self.values):
            for layer in tensors:
                saved = layer[a, :, :length_a].clone()  # (K, length_a, hd)
                layer[a, :, :length_b] = layer[b, :, :length_b]
                layer[b, :, :length_a] = saved
        self.lengths[a], self.lengths[b] = length_b, length_a

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        """Make row ``target`` hold the first ``length`` positions of row ``source`` (which keeps its own)."""
        if source == target or not 0 <= length <= self.lengths[source]:
            raise SpecdraftError(f"cannot copy {length} positions of row {source} (length {self.lengths[source]}) "
                                 f"to row {target}")
        for tensors in (self.keys, self.values):
            for layer in tensors:
                layer[target, :, :length] = layer[source, :, :length]
        self.lengths[target] = length

    def begin_forward(self, rows: list[int], num_new: list[int], steps: int) -> None:
        """Reserve slots for a forward over ``rows`` feeding ``num_new[i]`` real tokens each (of ``steps``)."""
        lengths = torch.tensor([self.lengths[r] for r in rows], dtype=torch.long)  # (n,)
        if int(lengths.max()) + steps > self.capacity:
            raise SpecdraftError(f"batched KV cache capacity {self.capacity} exceeded: a row holds "
                                 f"{int(lengths.max())} positions and {steps} more are fed")
        self._slots = lengths[:, None] + torch.arange(steps)  # (n, T)
        self._rows = torch.tensor(rows, dtype=torch.long)[:, None]  # (n, 1)
        self._end = int(lengths.max()) + steps
        dense = rows == list(range(rows[0], rows[0] + len(rows)))
        self._view = slice(rows[0], rows[0] + len(rows)) if dense else self._rows[:, 0]
        self._row_ids = rows

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one layer's new keys and values (n, T, K, hd) in the reserved slots; return the rows' keys and
        values so far, each (n, K, max length + T, hd): views into the cache for dense rows, else gathered."""
        dtype = self.keys[layer].dtype  # the cache's format: rounded once, as the batch-1 cache writes it
        self.keys[layer][self._rows, :, self._slots] = keys.to(dtype)  # index (n, T) -> (n, T, K, hd)
        self.values[layer][self._rows, :, self._slots] = values.to(dtype)
        return self.keys[layer][self._view, :, : self._end], self.values[layer][self._view, :, : self._end]

    def end_forward(self, num_new: list[int]) -> None:
        """Mark each row's ``num_new[i]`` fed tokens valid (a verify then crops or compacts them)."""
        for row, count in zip(self._row_ids, num_new, strict=True):
            self.lengths[row] += count
        self._slots = self._rows = None


def new_batched_cache(model, max_rows: int, capacity: int) -> BatchedKVCache:
    """An empty batched cache for ``model`` (a NativeLlama)."""
    if capacity < 1:
        raise SpecdraftError(f"KV cache capacity must be at least 1, got {capacity}")
    if max_rows < 1:
        raise SpecdraftError(f"batch size must be at least 1, got {max_rows}")
    config = model.config
    dtype = getattr(model, "cache_dtype", model.dtype)  # a quantized model's cache format (fp16 by default)
    return BatchedKVCache(config.num_hidden_layers, max_rows, config.num_key_value_heads, capacity, config.head_dim,
                          dtype, model.rope_cos.device)


def supports_batching(model) -> bool:
    """Whether ``model`` runs ragged batched forwards (the native Llama does; other models decode one at a time)."""
    return all(hasattr(model, name) for name in ("layers", "embed_tokens", "lm_head", "rope_cos"))


def _rope(model, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (n, T, 1, hd/2) of the positions (n, T)."""
    return model.rope_cos[positions].unsqueeze(2), model.rope_sin[positions].unsqueeze(2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, transformers' half-split layout. x: (n, T, heads, hd); cos, sin: (n, T, 1, hd/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _project(layer, name: str, x: torch.Tensor) -> torch.Tensor:
    """Projection ``name`` of a decoder layer: ``F.linear`` on dense weights, the block kernel on quantized ones."""
    if layer.quantized:
        return layer.linear(name, x)
    return F.linear(x, getattr(layer, f"{name}_weight"), getattr(layer, f"{name}_bias"))


def _layer(layer, hidden: torch.Tensor, cache: BatchedKVCache, index: int, rope, mask: torch.Tensor,
           rowwise: bool) -> torch.Tensor:
    """One pre-norm Llama block over (n, T, D) with grouped-query attention under the per-row mask (n, 1, G*T, S):
    ``rowwise``, each query on its own (the row-invariant kernel the batch-1 steps use, row by row with its own
    mask), so a row's k-token verify equals its k 1-token steps bit for bit; else the folded queries through SDPA
    (a prefill, or a model without the row path)."""
    batch, steps, _ = hidden.shape
    heads, kv_heads, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
    normed = F.rms_norm(hidden, layer.attn_norm.shape, layer.attn_norm, layer.eps)  # (n, T, D)
    qkv = _project(layer, "qkv", normed).view(batch, steps, -1, head_dim)  # (n, T, H+2K, hd)
    rotated = _rotate(qkv[:, :, : heads + kv_heads], *rope)  # (n, T, H+K, hd)
    queries, new_keys = rotated.split((heads, kv_heads), dim=2)  # (n, T, H, hd), (n, T, K, hd)
    keys, values = cache.write(index, new_keys, qkv[:, :, heads + kv_heads :])  # (n, K, S, hd)
    if rowwise:
        out = torch.cat([rowgemm.attention(queries[i : i + 1], keys[i : i + 1], values[i : i + 1], mask[i, 0, :steps])
                         for i in range(batch)])  # (n, T, H*hd)
    else:
        out = _folded_attention(queries, keys, values, mask, kv_heads)  # (n, T, H*hd)
    hidden = hidden + _project(layer, "o", out)  # (n, T, D)
    normed = F.rms_norm(hidden, layer.mlp_norm.shape, layer.mlp_norm, layer.eps)
    gate, up = _project(layer, "gate_up", normed).chunk(2, dim=-1)  # (n, T, F) each
    return hidden + _project(layer, "down", F.silu(gate) * up)  # (n, T, D)


def _folded_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      kv_heads: int) -> torch.Tensor:
    """SDPA of the queries (n, T, H, hd) folded by KV head, over keys and values (n, K, S, hd) under the mask
    (n, 1, G*T, S). Returns (n, T, H*hd)."""
    batch, steps, heads, head_dim = queries.shape
    groups = heads // kv_heads
    if keys.dtype != queries.dtype:  # a cache in its own format, widened exactly
        keys, values = keys.to(queries.dtype), values.to(queries.dtype)
    folded = queries.reshape(batch, steps, kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4)  # (n, K, G, T, hd)
    folded = folded.reshape(batch, kv_heads, groups * steps, head_dim)  # (n, K, G*T, hd)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask)  # (n, K, G*T, hd)
    return out.reshape(batch, kv_heads, groups, steps, head_dim).permute(0, 3, 1, 2, 4).reshape(batch, steps, -1)


def _fused_layers(model) -> list | None:
    """A block-quantized model's fused layer calls (:func:`~specdraft.models.quantized.fused_layer_rows`), where
    every layer has one and the kernels run here; else None (the layer's own ops)."""
    fused = getattr(model, "_fused", None)
    if not fused or any(layer is None for layer in fused) or model.config.head_dim % 8 or \
            model.rope_cos.device.type != "cpu" or not rowgemm.available():
        return None
    return fused


def _fused_chunks(steps: int, lengths: torch.Tensor, rope, visible: torch.Tensor) -> list[tuple]:
    """A forward's chunks of up to ROWS_MAX tokens for the fused calls, made once for every layer: (begin, end, each
    row's first slot, cos and sin (n, Tc, 1, hd/2), the rows' masks (n, Tc, S) of ``visible`` (n, T, S))."""
    cos, sin = rope  # (n, T, 1, hd/2) each
    chunks = []
    for begin in range(0, steps, packing.ROWS_MAX):
        end = min(steps, begin + packing.ROWS_MAX)
        chunks.append((begin, end, (lengths + begin).tolist(), cos[:, begin:end].contiguous(),
                       sin[:, begin:end].contiguous(), visible[:, begin:end]))
    return chunks


def _fused_rows(fused, hidden: torch.Tensor, cache: BatchedKVCache, index: int, rows: list[int],
                chunks: list[tuple]) -> torch.Tensor:
    """Decoder layer ``index`` of a block-quantized model over (n, T, D) as fused calls over the forward's chunks of
    up to ROWS_MAX tokens of every row (:func:`_fused_chunks`), in order: each token's arithmetic is that of a batch-1
    1-token step (batch-1 decoding and its prefill in chunks do the same), so every row's keys, values and logits are
    those its batch-1 decoding computes, bit for bit, whatever else is in the batch."""
    keys, values = cache.keys[index], cache.values[index]
    if len(chunks) == 1:
        _, _, starts, cos, sin, mask = chunks[0]
        return quantized.fused_layer_rows(hidden, fused, keys, values, rows, starts, cos, sin, mask)
    out = [quantized.fused_layer_rows(hidden[:, begin:end].contiguous(), fused, keys, values, rows, starts, cos, sin,
                                      mask) for begin, end, starts, cos, sin, mask in chunks]
    return torch.cat(out, dim=1)  # (n, T, D)


def _attends_rowwise(model, steps: int) -> bool:
    """Whether a forward of ``steps`` tokens attends each query on its own, as the model's batch-1 steps after a
    prefill do (:meth:`~specdraft.models.native_llama.NativeLlama._rowwise`): then plain decoding and every verify
    of the batched path agree bit for bit."""
    rows = getattr(model, "_rowwise", None)
    return rows is not None and rows(steps) and model.rope_cos.device.type == "cpu" and rowgemm.available()


def _full_mask(lengths: torch.Tensor, local: torch.Tensor, end: int) -> torch.Tensor:
    """Row i, token t sees its row's cached slots ``< lengths[i]`` and the new slots its local mask allows.

    Args:
        lengths: (n,) cached positions per row; local: (n, T, T) bool among the new tokens; end: slots attended.
    Returns:
        (n, T, end) bool (every query head of a row's token shares it).
    """
    batch, steps, _ = local.shape
    slots = torch.arange(end)  # (S,)
    mask = (slots[None, None, :] < lengths[:, None, None]).expand(batch, steps, end).clone()  # (n, T, S)
    new = lengths[:, None] + torch.arange(steps)  # (n, T) slots of the new tokens
    mask.scatter_(2, new[:, None, :].expand(batch, steps, steps), local)
    return mask


@torch.no_grad()
def batched_forward(model, cache: BatchedKVCache, input_ids: torch.Tensor, num_new: list[int],
                    first_row: int | list[int] = 0, offsets: torch.Tensor | None = None,
                    local_mask: torch.Tensor | None = None, return_hidden: bool = False, want_logits: bool = True,
                    last_only: bool = False, logits_weight: torch.Tensor | None = None,
                    hidden_layers: Sequence[int] = ()):
    """A ragged forward of rows ``first_row .. first_row + n - 1`` (or of the given list of rows: dense rows attend
    views of the cache, scattered rows gathered copies, cheap only for a small model such as a draft model; the
    fused calls of a block-quantized model read and write any rows in place).

    Args:
        input_ids: (n, T) ids; row i's first ``num_new[i]`` are real, the rest padding.
        num_new: real tokens per row; each row's length grows by it (verification crops or compacts it back).
        offsets: (n, T) position of each token minus its row's length, default ``0 .. T-1`` (a tree gives depths).
        local_mask: (n, T, T) bool among the new tokens, default causal; padding rows should stay causal.
        return_hidden: also return the final-normed hidden states (n, T, D).
        hidden_layers: with ``return_hidden``, also the residual stream entering each of these layers (EAGLE-3's
            features, as :meth:`~specdraft.models.native_llama.NativeLlama.forward` returns them): then a pair
            (final-normed (n, T, D), entering ``hidden_layers`` concatenated (n, T, k*D)) in place of the states.
        want_logits: False skips the LM head (a prefill) and returns None in place of the logits.
        last_only: logits of each row's last real token only, (n, 1, V).
        logits_weight: (N, D) replaces the LM head (a draft vocabulary's rows), as in the batch-1 forward.

    Returns:
        (n, T, V) float32 logits (or None), and the hidden states when asked.
    """
    batch, steps = input_ids.shape
    rows = list(range(first_row, first_row + batch)) if isinstance(first_row, int) else list(first_row)
    shapes_differ = len({batch, len(num_new), len(rows)}) != 1
    if shapes_differ or max(rows) >= cache.max_rows or min(num_new) < 1 or max(num_new) > steps:
        raise SpecdraftError(f"batched forward: input {tuple(input_ids.shape)} does not match rows {num_new}")
    lengths = torch.tensor([cache.lengths[r] for r in rows], dtype=torch.long)  # (n,)
    cache.begin_forward(rows, num_new, steps)
    offsets = torch.arange(steps).expand(batch, steps) if offsets is None else offsets  # (n, T)
    positions = lengths[:, None] + offsets  # (n, T)
    if int(positions.max()) >= model.max_context:
        raise SpecdraftError(f"positions must lie in 0 .. {model.max_context - 1}")
    if local_mask is None:
        local_mask = torch.ones(steps, steps, dtype=torch.bool).tril().expand(batch, steps, steps)
    visible = _full_mask(lengths, local_mask, cache._end).to(model.rope_cos.device)  # (n, T, S)
    rope = _rope(model, positions.to(model.rope_cos.device))
    hidden = model.embed_tokens(input_ids)  # (n, T, D)
    taps, aux = set(hidden_layers), []
    if sorted(taps) != list(hidden_layers) or any(not 0 <= i < len(model.layers) for i in taps):
        raise SpecdraftError(f"hidden_layers must be increasing indices in 0 .. {len(model.layers) - 1}, "
                             f"got {list(hidden_layers)}")
    fused = _fused_layers(model)
    if fused is not None:
        chunks = _fused_chunks(steps, lengths, rope, visible)
    else:  # the layer's own ops: the mask folded over each KV head's group of query heads
        groups = model.config.num_attention_heads // model.config.num_key_value_heads
        mask, rowwise = visible.repeat(1, groups, 1).unsqueeze(1), _attends_rowwise(model, steps)  # (n, 1, G*T, S)
    for index, layer in enumerate(model.layers):
        if index in taps:
            aux.append(hidden)  # (n, T, D)
        if fused is not None:
            hidden = _fused_rows(fused[index], hidden, cache, index, rows, chunks)
        else:
            hidden = _layer(layer, hidden, cache, index, rope, mask, rowwise)
    cache.end_forward(num_new)
    hidden = model.final_norm(hidden)  # (n, T, D)
    head_in = hidden[torch.arange(batch), torch.tensor(num_new) - 1][:, None] if last_only else hidden  # (n, 1|T, D)
    logits = model.lm_head(head_in, logits_weight, prepacked=False) if want_logits else None  # (n, 1 or T, V)
    if not return_hidden:
        return logits
    return (logits, (hidden, torch.cat(aux, dim=-1))) if taps else (logits, hidden)  # aux: (n, T, k*D)
