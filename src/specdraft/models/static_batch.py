"""Fixed-shape batched decoding of :class:`~specdraft.models.native_llama.NativeLlama`, for throughput: the engine
behind ``distill-data --engine native`` on CUDA.

Where :mod:`specdraft.models.batched_llama` serves ragged speculative batches (any number of new tokens per row,
trees, rows that come and go), here every row of a :class:`StaticBatch` is one answer being written one token a step,
in a preallocated cache of ``rows`` x ``capacity`` slots. A decode step is a pure function of static buffers (the
rows' last tokens and positions), so on CUDA it is captured once per shape as a CUDA graph and replayed: a 135M
model at a large batch is bound by kernel launches otherwise (gpt-fast decodes with CUDA graphs for the same
reason).

- **Prefill without padding waste.** Prompts are prefilled in chunks of similar length (right-padded to the chunk's
  longest, causal attention within the prompt only); each row's last real token gives its first logits. A row's
  padding slots sit beyond its length and are overwritten by its decode steps before anything attends them.
- **Decode.** Row i's token is written at slot ``positions[i]`` and attends slots ``<= positions[i]``; the step
  attends the first ``end`` slots only (``end`` rounded up to :data:`END_STEP`: one graph per bucket, not per step),
  and runs the first ``n`` rows (a smaller batch once rows are dropped, :meth:`StaticBatch.keep_rows`).
- **Graphs.** All graphs share one memory pool and write their logits into one buffer; they are replayed one at a
  time on one stream, so sharing is safe. On the CPU the same step runs eagerly (the fp32 tests run it there).
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.nn.functional as F

from specdraft.errors import SpecdraftError

GRAPHS_ENV = "SPECDRAFT_CUDA_GRAPHS"  # "0" decodes eagerly (for comparisons)
END_STEP = 64  # attended slots are rounded up to a multiple of this (one CUDA graph per bucket)
PREFILL_TOKENS = 16_384  # padded prompt tokens per prefill chunk


class StaticBatch:
    """A preallocated cache of ``rows`` x ``capacity`` slots for ``model`` and the decode step over it.

    Args:
        model: a NativeLlama (on any device; CUDA graphs are used on CUDA when ``graphs``).
        rows: the most answers decoded together.
        capacity: slots per row (longest prompt + most new tokens).
    """

    def __init__(self, model, rows: int, capacity: int, graphs: bool = True) -> None:
        if rows < 1 or capacity < 2:
            raise SpecdraftError(f"a static batch needs rows >= 1 and capacity >= 2, got {rows} and {capacity}")
        if capacity > model.max_context:
            raise SpecdraftError(f"capacity {capacity} exceeds the model's context of {model.max_context} positions")
        config, device = model.config, model.embed_weight.device
        shape = (rows, config.num_key_value_heads, capacity, config.head_dim)  # (R, K, S, hd)
        with torch.inference_mode(False):
            self.keys = [torch.zeros(shape, dtype=model.dtype, device=device) for _ in range(config.num_hidden_layers)]
            self.values = [torch.zeros_like(k) for k in self.keys]
            self.tokens = torch.zeros(rows, dtype=torch.long, device=device)  # (R,) each row's newest token
            self.positions = torch.zeros(rows, dtype=torch.long, device=device)  # (R,) where it is written
            self.logits = torch.zeros(rows, model.vocab_size, dtype=model.dtype, device=device)  # (R, V)
        self.model, self.rows, self.capacity, self.device = model, rows, capacity, device
        self.row_ids = torch.arange(rows, device=device)  # (R,)
        self.slot_ids = torch.arange(capacity, device=device)  # (S,)
        self.use_graphs = graphs and device.type == "cuda" and os.environ.get(GRAPHS_ENV, "1") != "0"
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], rows: list[int] | None = None) -> torch.Tensor:
        """Write prompt i into row ``rows[i]`` (default: row i) and return each prompt's next-token logits (n, V) in
        the model's dtype; those rows' ``positions`` are set to the prompt lengths (the other rows are untouched)."""
        rows = list(range(len(prompts))) if rows is None else rows
        if not prompts or len(prompts) > self.rows or min(map(len, prompts)) < 1:
            raise SpecdraftError(f"prefill needs 1 .. {self.rows} non-empty prompts, got {len(prompts)}")
        if len(rows) != len(prompts) or len(set(rows)) != len(rows) or not all(0 <= r < self.rows for r in rows):
            raise SpecdraftError(f"prefill needs one distinct row in 0 .. {self.rows - 1} per prompt, got {rows}")
        if max(map(len, prompts)) >= self.capacity:
            raise SpecdraftError(f"a prompt of {max(map(len, prompts))} tokens leaves no room in {self.capacity} slots")
        lengths = torch.tensor([len(p) for p in prompts])  # (n,)
        out = torch.empty(len(prompts), self.model.vocab_size, dtype=self.model.dtype, device=self.device)
        for chunk in _chunks(prompts):
            width = max(len(prompts[i]) for i in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)  # (c, W) right-padded
            for row, i in enumerate(chunk):
                ids[row, : len(prompts[i])] = torch.tensor(prompts[i])
            where = torch.tensor([rows[i] for i in chunk], device=self.device)  # (c,) cache rows
            last = (lengths[chunk] - 1).to(self.device)  # (c,)
            out[torch.tensor(chunk, device=self.device)] = self._prefill_chunk(ids.to(self.device), where, last)
        self.positions[torch.tensor(rows, device=self.device)] = lengths.to(self.device)
        return out

    def _prefill_chunk(self, ids: torch.Tensor, rows: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Causal forward of right-padded prompts ``ids`` (c, W) into cache ``rows`` (c,), slots 0 .. W-1; returns
        the logits (c, V) at ``last`` (c,), each row's last real token."""
        model = self.model
        chunk, width = ids.shape
        cos, sin = model.rope_cos[:width][None, :, None], model.rope_sin[:width][None, :, None]  # (1, W, 1, hd/2)
        hidden = F.embedding(ids, model.embed_weight)  # (c, W, D)
        for index, layer in enumerate(model.layers):
            heads, kv_heads, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
            normed = F.rms_norm(hidden, layer.attn_norm.shape, layer.attn_norm, layer.eps)  # (c, W, D)
            qkv = F.linear(normed, layer.qkv_weight, layer.qkv_bias).view(chunk, width, -1, head_dim)  # (c,W,H+2K,hd)
            rotated = _rotate(qkv[:, :, : heads + kv_heads], cos, sin)  # (c, W, H+K, hd)
            queries, keys = rotated.split((heads, kv_heads), dim=2)  # (c, W, H, hd), (c, W, K, hd)
            values = qkv[:, :, heads + kv_heads :]  # (c, W, K, hd)
            self.keys[index][rows, :, :width] = keys.transpose(1, 2)  # (c, K, W, hd)
            self.values[index][rows, :, :width] = values.transpose(1, 2)
            groups = heads // kv_heads
            attended = F.scaled_dot_product_attention(
                queries.transpose(1, 2), keys.transpose(1, 2).repeat_interleave(groups, dim=1),
                values.transpose(1, 2).repeat_interleave(groups, dim=1), is_causal=True)  # (c, H, W, hd)
            hidden = hidden + F.linear(attended.transpose(1, 2).reshape(chunk, width, -1), layer.o_weight, layer.o_bias)
            hidden = hidden + _mlp(layer, hidden)
        hidden = hidden[torch.arange(chunk, device=ids.device), last]  # (c, D)
        hidden = F.rms_norm(hidden, model.norm_weight.shape, model.norm_weight, model.eps)
        return F.linear(hidden, model.lm_head_weight)  # (c, V)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, n: int, end: int) -> torch.Tensor:
        """Feed ``tokens`` (n,) to rows 0 .. n-1 at their positions, attending their first ``end`` slots (at least
        every row's position + 1); return the logits (n, V), a view of a buffer the next step overwrites, and
        advance the positions."""
        end = min(self.capacity, -(-end // END_STEP) * END_STEP)
        self.tokens[:n] = tokens
        graph = self._graphs.get((n, end))
        if graph is not None:
            graph.replay()
        elif self.use_graphs:
            self._graphs[(n, end)] = self._capture(n, end)  # its warm-up ran this step
        else:
            self._step(n, end)
        self.positions[:n] += 1
        return self.logits[:n]

    def _capture(self, n: int, end: int) -> torch.cuda.CUDAGraph | None:
        """Run the step once on a side stream (the real step: its writes are this step's), then capture it. Where
        capture fails, the batch decodes eagerly from then on (one warning): the step already ran."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._step(n, end)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                self._step(n, end)
        except RuntimeError as exc:
            warnings.warn(f"specdraft: CUDA graph capture failed ({str(exc).splitlines()[0][:200]}); decoding "
                          f"eagerly", stacklevel=2)
            torch.cuda.synchronize(self.device)
            self.use_graphs = False
            return None
        return graph

    def _step(self, n: int, end: int) -> None:
        """One token for rows 0 .. n-1: keys and values written at their positions, logits into ``self.logits``.
        Only static buffers are read and written (a CUDA graph replays it)."""
        model, positions, rows = self.model, self.positions[:n], self.row_ids[:n]
        cos, sin = model.rope_cos[positions][:, None, None], model.rope_sin[positions][:, None, None]  # (n,1,1,hd/2)
        seen = (self.slot_ids[:end][None, :] <= positions[:, None])[:, None, None]  # (n, 1, 1, end)
        hidden = F.embedding(self.tokens[:n, None], model.embed_weight)  # (n, 1, D)
        for index, layer in enumerate(model.layers):
            heads, kv_heads, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
            normed = F.rms_norm(hidden, layer.attn_norm.shape, layer.attn_norm, layer.eps)  # (n, 1, D)
            qkv = F.linear(normed, layer.qkv_weight, layer.qkv_bias).view(n, 1, -1, head_dim)  # (n, 1, H+2K, hd)
            rotated = _rotate(qkv[:, :, : heads + kv_heads], cos, sin)  # (n, 1, H+K, hd)
            self.keys[index][rows, :, positions] = rotated[:, 0, heads:]  # (n, K, hd)
            self.values[index][rows, :, positions] = qkv[:, 0, heads + kv_heads :]
            queries = rotated[:, 0, :heads].reshape(n, kv_heads, heads // kv_heads, head_dim)  # (n, K, G, hd)
            attended = F.scaled_dot_product_attention(queries, self.keys[index][:n, :, :end],
                                                      self.values[index][:n, :, :end], attn_mask=seen)  # (n,K,G,hd)
            hidden = hidden + F.linear(attended.reshape(n, 1, -1), layer.o_weight, layer.o_bias)  # (n, 1, D)
            hidden = hidden + _mlp(layer, hidden)
        hidden = F.rms_norm(hidden[:, 0], model.norm_weight.shape, model.norm_weight, model.eps)  # (n, D)
        self.logits[:n] = F.linear(hidden, model.lm_head_weight)  # (n, V)

    @torch.inference_mode()
    def keep_rows(self, keep: torch.Tensor) -> None:
        """Move rows ``keep`` (m,) ascending to rows 0 .. m-1 (caches and positions), so that the next steps can run
        a smaller batch."""
        m = keep.shape[0]
        for tensors in (self.keys, self.values):
            for layer in tensors:
                layer[:m] = layer.index_select(0, keep)  # (m, K, S, hd)
        self.positions[:m] = self.positions.index_select(0, keep)


def _chunks(prompts: list[list[int]]) -> list[list[int]]:
    """Prompt indices in chunks of similar length (ascending), each of at most :data:`PREFILL_TOKENS` padded tokens
    (a longer prompt alone)."""
    chunks, chunk = [], []
    for i in sorted(range(len(prompts)), key=lambda i: len(prompts[i])):
        if chunk and (len(chunk) + 1) * len(prompts[i]) > PREFILL_TOKENS:
            chunks.append(chunk)
            chunk = []
        chunk.append(i)
    return chunks + [chunk]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, transformers' half-split layout. x: (n, T, heads, hd); cos, sin broadcast to
    (n, T, 1, hd/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _mlp(layer, hidden: torch.Tensor) -> torch.Tensor:
    """The layer's SwiGLU block on its normed input: (n, T, D) -> (n, T, D)."""
    normed = F.rms_norm(hidden, layer.mlp_norm.shape, layer.mlp_norm, layer.eps)
    gate, up = F.linear(normed, layer.gate_up_weight, layer.gate_up_bias).chunk(2, dim=-1)  # (n, T, F) each
    return F.linear(F.silu(gate) * up, layer.down_weight, layer.down_bias)
