"""The native Llama decoding from block-quantized weights: a GGUF's own blocks, or a dense checkpoint quantized at load.

:class:`QuantizedLlama` is a :class:`~specdraft.models.native_llama.NativeLlama` whose four projections per layer,
embedding table and LM head are :class:`~specdraft.models.quantized.QuantizedWeight` blocks (no dense copy is
kept); activations, norms and the KV cache are float32. A GGUF (``general.architecture`` llama) is read with gguf-py
and packed once; the packed blocks are cached beside the converted checkpoint (``quantized-<fingerprint>.safetensors``)
so that later loads map them from disk. llama.cpp stores the q and k projections with their rows permuted for its
rotary layout; the rows are put back in transformers' order (exact: a permutation of whole rows).

The KV cache holds keys and values in :data:`KV_CACHE_DEFAULT` (``SPECDRAFT_KV_CACHE`` or ``--kv-cache``:
``float32``, ``float16`` or ``bfloat16``), rounded once as they are written: the cache format is part of the
model's arithmetic, for plain and speculative decoding alike (a k-token verify still reproduces k 1-token steps bit
for bit), so it changes outputs only against another format. At long contexts the cache is what a step reads
besides the weights (fp32: 46 KB a token for SmolLM2, 94 MB at 2,048 tokens); half of it halves that traffic.

Batch-1 forwards of up to ``packed.ROWS_MAX`` tokens run each decoder layer as one fused C++ call
(``quantlayer.cpp``) with row-invariant kernels, so a k-token verify reproduces k 1-token steps bit for bit; a longer
one (a prompt's prefill) runs each layer as such calls over chunks of ``ROWS_MAX`` tokens, so it writes the cache
that token-by-token steps would.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

import specdraft.models.packed as packing
import specdraft.models.quantized as quantization
from specdraft.errors import SpecdraftError
from specdraft.models.hugepages import with_huge_page_copies
from specdraft.models.native_llama import DecoderLayer, NativeLlama, check_supported, rope_table, supports

_LAYOUT_VERSION = 1  # bump when pack_blocks' layout changes: cached packs of another version are rebuilt
_PROJECTIONS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
                "down": ("ffn_down",)}  # native fused name -> GGUF tensor names, concatenated by rows
SCHEMES = {"int8": (quantization.Q8_0, quantization.Q8_0), "int4": (quantization.Q4_1, quantization.Q8_0)}
# --quantize name -> (layers' kind, embedding and LM head's kind), as llama.cpp keeps the token table at 8 bits
KV_CACHE_ENV = "SPECDRAFT_KV_CACHE"
KV_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
KV_CACHE_DEFAULT = "float16"  # as llama.cpp's default; agreement with float32 measured in docs/quantized.md


def kv_cache_dtype() -> torch.dtype:
    """The KV cache format of quantized models built from now on: ``SPECDRAFT_KV_CACHE``, else the default."""
    name = os.environ.get(KV_CACHE_ENV) or KV_CACHE_DEFAULT
    if name not in KV_CACHE_DTYPES:
        raise SpecdraftError(f"{KV_CACHE_ENV} must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name]


def fits_blocks(config) -> bool:
    """Whether a transformers config can be built on blocks (:meth:`QuantizedLlama.from_dense`): a Llama the native
    path runs, every projection's input a whole number of 32-value blocks."""
    if not supports(config):
        return False
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    widths = (config.hidden_size, config.intermediate_size, config.num_attention_heads * head_dim)
    return all(width % quantization.BLOCK == 0 for width in widths)


class QuantizedLlama(NativeLlama):
    """Llama causal LM on block-quantized weights (see the module docstring). Build it with :meth:`from_gguf` or
    :meth:`from_dense`; :attr:`dtype` is float32 (activations and cache)."""

    def __init__(self, config, name: str, weights: dict[str, quantization.QuantizedWeight],
                 norms: dict[str, torch.Tensor], biases: dict[str, torch.Tensor] | None = None) -> None:
        nn.Module.__init__(self)
        check_supported(config, name)
        weights = _in_huge_pages(weights)  # every step streams them: 2 MiB pages spare a page walk per 4 KiB
        self.config, self.name, self.dtype = config, name, torch.float32
        self.kv_dtype = kv_cache_dtype()  # the KV cache's format (activations stay float32)
        self.vocab_size, self.max_context = config.vocab_size, config.max_position_embeddings
        self.eps = config.rms_norm_eps
        self.layers = nn.ModuleList(DecoderLayer(config, torch.float32, dense=False)
                                    for _ in range(config.num_hidden_layers))
        for index, layer in enumerate(self.layers):
            layer.quantized = {name: weights[f"layers.{index}.{name}"] for name in _PROJECTIONS}
            layer.attn_norm.data = norms[f"layers.{index}.attn_norm"].float()
            layer.mlp_norm.data = norms[f"layers.{index}.mlp_norm"].float()
            for name in _PROJECTIONS:
                if getattr(layer, f"{name}_bias") is not None:
                    getattr(layer, f"{name}_bias").data = (biases or {})[f"layers.{index}.{name}"].float()
        self.norm_weight = nn.Parameter(norms["norm"].float(), requires_grad=False)
        self.embed_quantized = weights["embed"]
        self.head_quantized = weights.get("lm_head", self.embed_quantized)
        cos, sin = rope_table(config, torch.float32)
        self.register_buffer("rope_cos", cos, persistent=False)  # (P, hd/2)
        self.register_buffer("rope_sin", sin, persistent=False)  # (P, hd/2)
        self.packed_head = None
        self._dense: dict[str, torch.Tensor] = {}
        self._row_heads: list[tuple[torch.Tensor, quantization.QuantizedWeight]] = []  # logits_weight -> blocks
        self._fused = [None if any(getattr(layer, f"{name}_bias") is not None for name in _PROJECTIONS)
                       else quantization.FusedLayer.of(layer) for layer in self.layers]
        self._stack_of: list | None = None  # the list of fused layers self._stack was made from
        self._stack: quantization.FusedStack | None = None
        self.eval()

    # ---- what differs from the dense model
    @property
    def reads_prefix_exactly(self) -> bool:
        """Whether a forward over tokens after cached ones writes the keys and values, and gives the logits, that
        one forward over all of them would, bit for bit: every layer fused (row-invariant products and attention,
        prefill included), so a cache kept from an earlier sequence can serve a later prompt's shared prefix
        (:class:`specdraft.decoding.PrefixCache`)."""
        return self.config.head_dim % 8 == 0 and all(fused is not None for fused in self._fused)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache's format, :attr:`kv_dtype` (fixed when the model is built)."""
        return self.kv_dtype

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The norm before the LM head in one C++ call (``quantlayer.cpp``), each row with the decoder layers' norm
        arithmetic: (..., D) -> (..., D)."""
        return quantization.rms_norm(hidden, self.norm_weight, self.eps)

    def prepack(self, kind: str | None = None) -> bool:
        """Nothing to do: the blocks are packed at load."""
        return True

    @property
    def packing(self) -> str:
        """The block kinds, e.g. ``q4_1+q8_0`` (layers, then the LM head)."""
        return f"{self.layers[0].quantized['qkv'].name}+{self.head_quantized.name}"

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights a full forward reads (the LM head once, even when tied)."""
        layers = sum(weight.nbytes for layer in self.layers for weight in layer.quantized.values())
        return layers + self.head_quantized.nbytes

    @property
    def parameter_count(self) -> int:
        """Weights of the model, quantized ones by their shape (a tied table counted once)."""
        tables = {id(w): w for w in (self.embed_quantized, self.head_quantized)}.values()
        blocks = [w for layer in self.layers for w in layer.quantized.values()] + list(tables)
        return sum(w.out_features * w.in_features for w in blocks) + sum(p.numel() for p in self.parameters())

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the quantized table, dequantized exactly: ids (...) -> (..., D) float32."""
        return quantization.rows(self.embed_quantized, input_ids)

    def lm_head(self, rows: torch.Tensor, logits_weight: torch.Tensor | None = None, prepacked: bool = True
                ) -> torch.Tensor:
        """Logits (..., V) float32; a ``logits_weight`` (N, D) (a drafter's vocabulary rows) is rounded to the LM
        head's block kind once, the first time it is given, and multiplied as blocks from then on."""
        if logits_weight is None:
            return quantization.linear(rows, self.head_quantized)  # (..., V) float32
        return quantization.linear(rows, self._head_rows(logits_weight))  # (..., N) float32

    def prepare_logits_weight(self, weight: torch.Tensor) -> None:
        """Round ``weight`` (N, D), a drafter's vocabulary rows, to blocks now rather than in its first forward (about
        0.1 s for 8,192 rows of 576: a cost of loading, not of the step that first drafts with the model)."""
        self._head_rows(weight)

    def _head_rows(self, weight: torch.Tensor) -> quantization.QuantizedWeight:
        for source, blocks in self._row_heads:
            if source is weight:
                return blocks
        blocks = with_huge_page_copies([quantization.quantize(weight, self.head_quantized.kind)], "packed")[0]
        self._row_heads = [(weight, blocks), *self._row_heads[:3]]  # a drafter keeps one table: a few suffice
        return blocks

    @property
    def embed_weight(self) -> torch.Tensor:
        """The embedding table (V, D) dequantized to float32, made once when a drafter asks for it (EAGLE heads and
        shared-embeddings drafters read the target's table); the target's own forward never uses it."""
        if "embed" not in self._dense:
            self._dense["embed"] = quantization.dequantize(self.embed_quantized)
        return self._dense["embed"]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The LM head (V, D) dequantized to float32 (the embedding table itself when tied), made once when asked."""
        if self.head_quantized is self.embed_quantized:
            return self.embed_weight
        if "head" not in self._dense:
            self._dense["head"] = quantization.dequantize(self.head_quantized)
        return self._dense["head"]

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        raise SpecdraftError(f"{self.name} holds quantized weights: load dense weights into a dense model")

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The weights dequantized exactly, under their transformers names (e.g. to export or inspect them)."""
        config = self.config
        heads, kv, hd, ffn = config.num_attention_heads, config.num_key_value_heads, config.head_dim, \
            config.intermediate_size
        out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": self.embed_weight,
                                        "model.norm.weight": self.norm_weight.detach()}
        if not config.tie_word_embeddings:
            out["lm_head.weight"] = self.lm_head_weight
        for index, layer in enumerate(self.layers):
            prefix = f"model.layers.{index}."
            q, k, v = quantization.dequantize(layer.quantized["qkv"]).split((heads * hd, kv * hd, kv * hd))
            gate, up = quantization.dequantize(layer.quantized["gate_up"]).split((ffn, ffn))
            out |= {prefix + "self_attn.q_proj.weight": q, prefix + "self_attn.k_proj.weight": k,
                    prefix + "self_attn.v_proj.weight": v,
                    prefix + "self_attn.o_proj.weight": quantization.dequantize(layer.quantized["o"]),
                    prefix + "mlp.gate_proj.weight": gate, prefix + "mlp.up_proj.weight": up,
                    prefix + "mlp.down_proj.weight": quantization.dequantize(layer.quantized["down"]),
                    prefix + "input_layernorm.weight": layer.attn_norm.detach(),
                    prefix + "post_attention_layernorm.weight": layer.mlp_norm.detach()}
        return out

    def _run_layers(self, hidden: torch.Tensor, cache, step, taps=(), aux: list[torch.Tensor] | None = None
                    ) -> torch.Tensor:
        stack = self._fused_stack()
        if not taps and step.rowwise and stack is not None and hidden.shape[0] == 1:  # a decode step, verify or tree
            return quantization.fused_layers(hidden, stack, cache.keys, cache.values, step.start, step.cos, step.sin,
                                             _rows_mask(step, hidden))
        for index in range(len(self._fused)):
            if index in taps:
                aux.append(hidden)  # (B, T, D)
            hidden = self._layer(index, hidden, cache, step)  # (B, T, D)
        return hidden

    def _fused_stack(self) -> quantization.FusedStack | None:
        """Every fused layer flattened for one call (None where they are not all fused), made again when
        :attr:`_fused` is replaced."""
        if self._stack_of is not self._fused:
            self._stack, self._stack_of = quantization.FusedStack.of(self._fused), self._fused
        return self._stack

    def _run_layer_subset(self, hidden: torch.Tensor, cache, step, layers: list[int]) -> torch.Tensor:
        for index in layers:
            hidden = self._layer(index, hidden, cache, step)  # (B, T, D)
        return hidden

    def _layer(self, index: int, hidden: torch.Tensor, cache, step) -> torch.Tensor:
        """Decoder layer ``index``: one fused call (``quantlayer.cpp``) for a row-wise batch-1 step, fused calls over
        chunks for a longer batch-1 forward (a prompt's prefill), else the layer's own ops (a batch, a tree of more
        than ROWS_MAX nodes, biases)."""
        fused = self._fused[index]
        if step.rowwise and fused is not None and hidden.shape[0] == 1:  # a decode step, verify or tree
            return quantization.fused_layer(hidden, fused, cache.keys[index], cache.values[index], step.start,
                                            step.cos, step.sin, _rows_mask(step, hidden))
        if fused is None or hidden.shape[0] != 1 or step.chunks is None:
            return self.layers[index](hidden, cache, index, step)
        return self._chunked_layer(fused, hidden, cache, index, step)

    def _chunked_layer(self, fused, hidden: torch.Tensor, cache, index: int, step) -> torch.Tensor:
        """Decoder layer ``index`` over (1, T, D) new tokens as the step's chunks of ROWS_MAX, in order, each one
        fused call with its causal mask over the slots before it and its own: the layer's weights stay in cache
        across the chunks, and every row's arithmetic is that of a 1-token step (the attention as
        :func:`rowgemm.attention`'s), so a prefill writes the keys and values that token-by-token steps would, bit
        for bit."""
        out = [quantization.fused_layer(hidden[:, begin:end].contiguous(), fused, cache.keys[index],
                                        cache.values[index], step.start + begin, step.cos[begin:end],
                                        step.sin[begin:end], mask) for begin, end, mask in step.chunks]
        return torch.cat(out, dim=1)  # (1, T, D)

    def _step(self, start: int, steps: int):
        """As the dense model's, but a forward of up to ROWS_MAX tokens into an empty cache is row-wise too (with an
        explicit causal mask): a one-token prompt's first plain step and its first verify then agree bit for bit. A
        longer causal forward (a prompt's prefill) carries its chunks of ROWS_MAX tokens, each a row-wise step after
        the ones before it, made once for every layer."""
        step = super()._step(start, steps)
        if steps > packing.ROWS_MAX and self.config.head_dim % 8 == 0:
            return replace(step, chunks=tuple(self._chunk(start, begin, min(steps, begin + packing.ROWS_MAX))
                                              for begin in range(0, steps, packing.ROWS_MAX)))
        if start > 0 or not self._rowwise(steps):
            return step
        groups = self.config.num_attention_heads // self.config.num_key_value_heads
        causal = torch.ones(steps, steps, dtype=torch.bool, device=self.rope_cos.device).tril()  # (T, T)
        return replace(step, mask=causal.repeat(groups, 1), explicit=True, rowwise=True)  # (G*T, T)

    def _chunk(self, start: int, begin: int, end: int) -> tuple[int, int, torch.Tensor]:
        """Tokens ``begin .. end`` of a forward from slot ``start``: their causal mask over the slots up to theirs."""
        device = self.rope_cos.device
        seen = torch.arange(start + end, device=device)  # (S,)
        return begin, end, seen[None, :] <= (start + torch.arange(begin, end, device=device))[:, None]  # (Tc, S)

    def _rowwise(self, steps: int) -> bool:
        """The block kernels are row-invariant at any number of rows; the attention too up to ROWS_MAX tokens."""
        return steps <= packing.ROWS_MAX and self.config.head_dim % 8 == 0

    # ---- construction
    @classmethod
    def from_dense(cls, model: NativeLlama, scheme: str) -> QuantizedLlama:
        """``model``'s weights rounded to blocks (``int8``: Q8_0 everywhere; ``int4``: Q4_1 layers, Q8_0 table):
        lossy with respect to ``model``."""
        if scheme not in SCHEMES:
            raise SpecdraftError(f"quantize must be one of {', '.join(SCHEMES)}, got {scheme!r}")
        layer_kind, table_kind = SCHEMES[scheme]
        weights = {"embed": quantization.quantize(model.embed_weight, table_kind)}
        if not model.config.tie_word_embeddings:
            weights["lm_head"] = quantization.quantize(model.lm_head_weight, table_kind)
        norms, biases = {"norm": model.norm_weight.detach()}, {}
        for index, layer in enumerate(model.layers):
            for name in _PROJECTIONS:
                weights[f"layers.{index}.{name}"] = quantization.quantize(getattr(layer, f"{name}_weight"), layer_kind)
                if getattr(layer, f"{name}_bias") is not None:
                    biases[f"layers.{index}.{name}"] = getattr(layer, f"{name}_bias").detach()
            norms[f"layers.{index}.attn_norm"], norms[f"layers.{index}.mlp_norm"] = layer.attn_norm, layer.mlp_norm
        return cls(model.config, f"{model.name} ({scheme})", weights, norms, biases)

    @classmethod
    def from_gguf(cls, gguf_file: str | Path, config, name: str, cache_folder: Path | None = None) -> QuantizedLlama:
        """The GGUF's own blocks (Q4_0, Q4_1, Q8_0 and F32/F16 norms), packed once and cached in ``cache_folder``."""
        path = Path(gguf_file)
        cached = None if cache_folder is None else cache_folder / f"quantized-{_fingerprint(path)}.safetensors"
        if cached is not None and cached.is_file():
            tensors = _load_cached(cached)
        else:
            tensors = _read_gguf(path, config)
            if cached is not None:
                _save_cached(tensors, cached)
        weights, norms, biases = _split_tensors(tensors)
        return cls(config, name, weights, norms, biases)


def _rows_mask(step, hidden: torch.Tensor) -> torch.Tensor | None:
    """A row-wise step's mask over its (1, T, D) ``hidden`` rows: its first T rows, (T, S), or None."""
    return None if step.mask is None else step.mask[: hidden.shape[1]]


def _in_huge_pages(weights: dict[str, quantization.QuantizedWeight]) -> dict[str, quantization.QuantizedWeight]:
    """``weights`` with their packed blocks copied into transparent huge pages (:mod:`specdraft.models.hugepages`),
    a weight named twice (a tied table) copied once; as they are where huge pages are not available."""
    return dict(zip(weights, with_huge_page_copies(list(weights.values()), "packed"), strict=True))


def _fingerprint(path: Path) -> str:
    """Names a packed copy of a GGUF: its size, modification time, name and the layout version."""
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{_LAYOUT_VERSION}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _gguf_rows(reader, name: str, config) -> tuple[torch.Tensor, int, int, int]:
    """A GGUF tensor's raw blocks (N, bytes) uint8, its ggml type and (N, K), rows in transformers' order."""
    tensor = next((t for t in reader.tensors if t.name == name), None)
    if tensor is None:
        raise SpecdraftError(f"GGUF has no tensor {name}")
    kind = int(tensor.tensor_type)
    if kind not in quantization.NAMES:
        raise SpecdraftError(f"GGUF tensor {name} is {tensor.tensor_type.name}: specdraft decodes Q4_0, Q4_1 and Q8_0 "
                             "blocks (give --dtype to decode a dense copy instead)")
    in_features, out_features = (int(v) for v in tensor.shape[:2])
    raw = torch.from_numpy(tensor.data.copy()).view(torch.uint8).reshape(out_features, -1)  # (N, bytes)
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(name.split(".")[-2])
    if heads is not None:  # llama.cpp's rotary permutation of the rows, undone
        order = torch.arange(out_features).view(heads, out_features // heads // 2, 2).transpose(1, 2).reshape(-1)
        raw = raw[order]
    return raw, kind, out_features, in_features


def _gguf_dense(reader, name: str) -> torch.Tensor | None:
    tensor = next((t for t in reader.tensors if t.name == name), None)
    if tensor is None:
        return None
    if tensor.tensor_type.name not in ("F32", "F16"):
        raise SpecdraftError(f"GGUF tensor {name} is {tensor.tensor_type.name}, expected F32 or F16")
    return torch.from_numpy(tensor.data.astype("float32").reshape(-1).copy())


def _read_gguf(path: Path, config) -> dict[str, torch.Tensor]:
    """Every tensor the model needs, packed: ``<name>.packed`` (uint8) with ``<name>.shape`` (kind, N, K) for
    quantized weights, plain float32 tensors for norms and biases."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise SpecdraftError(f"cannot read GGUF {path}: {exc}") from None
    arch = reader.fields.get("general.architecture")
    if arch is None or arch.contents() != "llama":
        raise SpecdraftError(f"GGUF {path} is not a llama model (general.architecture "
                             f"{None if arch is None else arch.contents()!r})")
    out: dict[str, torch.Tensor] = {}

    def put(name: str, gguf_names: list[str]) -> None:
        parts = [_gguf_rows(reader, g, config) for g in gguf_names]
        kinds = {kind for _, kind, _, _ in parts}
        if len(kinds) != 1:
            raise SpecdraftError(f"GGUF tensors {', '.join(gguf_names)} mix block types: specdraft fuses them")
        raw = torch.cat([p[0] for p in parts])
        weight = quantization.pack_blocks(raw, kinds.pop(), raw.shape[0], parts[0][3])
        out[f"{name}.packed"] = weight.packed
        out[f"{name}.shape"] = torch.tensor([weight.kind, weight.out_features, weight.in_features])

    put("embed", ["token_embd.weight"])
    if any(t.name == "output.weight" for t in reader.tensors):
        put("lm_head", ["output.weight"])
    out["norm"] = _gguf_dense(reader, "output_norm.weight")
    for index in range(config.num_hidden_layers):
        for name, parts in _PROJECTIONS.items():
            put(f"layers.{index}.{name}", [f"blk.{index}.{p}.weight" for p in parts])
            bias = [_gguf_dense(reader, f"blk.{index}.{p}.bias") for p in parts]
            if all(b is not None for b in bias):
                out[f"layers.{index}.{name}.bias"] = torch.cat(bias)
        out[f"layers.{index}.attn_norm"] = _gguf_dense(reader, f"blk.{index}.attn_norm.weight")
        out[f"layers.{index}.mlp_norm"] = _gguf_dense(reader, f"blk.{index}.ffn_norm.weight")
    missing = [name for name, tensor in out.items() if tensor is None]
    if missing:
        raise SpecdraftError(f"GGUF {path} lacks tensors for {', '.join(missing)}")
    return out


def _split_tensors(tensors: dict[str, torch.Tensor]):
    weights, norms, biases = {}, {}, {}
    for key, tensor in tensors.items():
        if key.endswith(".packed"):
            name = key.removesuffix(".packed")
            kind, out_features, in_features = (int(v) for v in tensors[f"{name}.shape"])
            weights[name] = quantization.QuantizedWeight(kind, tensor, out_features, in_features)
        elif key.endswith(".bias"):
            biases[key.removesuffix(".bias")] = tensor.clone()  # small: not a view that keeps the whole file mapped
        elif not key.endswith(".shape"):
            norms[key] = tensor.clone()
    return weights, norms, biases


def _save_cached(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write beside, then rename: a killed write leaves no half file under the final name."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp,
                  metadata={"format": "specdraft-quantized", "layout": json.dumps(_LAYOUT_VERSION)})
        os.replace(tmp, path)
    except OSError:  # a read-only cache: decode from the packed tensors in memory
        Path(tmp).unlink(missing_ok=True)


def _load_cached(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (SafetensorError, OSError) as exc:
        raise SpecdraftError(f"corrupt quantized cache {path}: {exc} (delete it to rebuild)") from None
