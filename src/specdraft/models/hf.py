"""Any transformers causal LM behind the :class:`~specdraft.models.base.CausalLM` interface.

Rollback uses ``DynamicCache.crop``, as transformers' own assisted generation does. This is the path for
architectures the native implementation does not cover, and for decoding on CUDA: the model and its cache live on
the model's device, while ids, positions and masks come in from the decoding loop on the CPU and logits and hidden
states go back to it there (one copy per forward), so drafters and verification never see another device.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from specdraft.errors import SpecdraftError


class HFCache:
    """A transformers ``DynamicCache`` with a capacity bound and a length view."""

    def __init__(self, capacity: int, config) -> None:
        self.cache = DynamicCache(config=config)
        self.capacity = capacity

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise SpecdraftError(f"cannot crop a cache of length {self.length} to {length}")
        if length < self.length:
            self.cache.crop(length - self.length)  # transformers 5 crops by a negative count of tokens to drop

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s keys (rotated, as transformers caches them) and values, each (B, K, length, hd)
        (:class:`~specdraft.models.base.ReadableKVCache`)."""
        layers = self.cache.layers
        if not -len(layers) <= layer < len(layers) or getattr(layers[layer], "keys", None) is None:
            raise SpecdraftError(f"layer {layer} of this transformers cache holds no keys ({len(layers)} layers)")
        return layers[layer].keys, layers[layer].values

    def compact(self, start: int, slots: list[int]) -> None:
        """Keep positions ``0 .. start - 1`` plus the given slots moved after them (the accepted tree path)."""
        length = self.length
        if not 0 <= start <= length or any(not start <= s < length for s in slots):
            raise SpecdraftError(f"cannot compact a cache of length {length} to {start} + slots {slots}")
        index = torch.cat([torch.arange(start), torch.tensor(slots, dtype=torch.long)])  # (start + m,)
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(-2, index.to(layer.keys.device))  # (B, K, start + m, hd)
                layer.values = layer.values.index_select(-2, index.to(layer.values.device))


class HFCausalLM:
    """Adapter from a transformers ``PreTrainedModel`` to :class:`CausalLM`."""

    def __init__(self, model: PreTrainedModel, name: str = "") -> None:
        self.model = model.eval()
        self.config = model.config
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_context = int(getattr(model.config, "max_position_embeddings", 1 << 30) or 1 << 30)
        self.dtype = model.dtype
        self.device = model.device
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters  # else: slice after

    def new_cache(self, capacity: int, batch_size: int = 1) -> HFCache:
        return HFCache(capacity, self.config)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: HFCache,
        positions: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        return_hidden: bool = False,
        logits_to_keep: int = 0,
        hidden_layers: Sequence[int] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`NativeLlama.forward` (``hidden_layers``: transformers' ``hidden_states[i]`` is the input of
        layer i, concatenated for the given i); a tree step passes ``positions`` (T,) and ``attention_mask`` (T, T) bool
        among the new tokens, or (T, S) over every slot; it reaches the model as a 4D additive mask (models that
        ignore 4D masks cannot verify trees)."""
        start, num_new = cache.length, input_ids.shape[1]
        if start + num_new > cache.capacity:
            raise SpecdraftError(f"KV cache capacity {cache.capacity} exceeded ({start} + {num_new} positions)")
        slots = torch.arange(start, start + num_new)  # (T,)
        mask = None
        if positions is not None or attention_mask is not None:
            positions = slots if positions is None else positions
            local = attention_mask if attention_mask is not None else torch.ones(num_new, num_new).tril().bool()
            if local.shape == (num_new, start + num_new):  # a mask over every slot, cached ones included
                seen = local.bool()
            else:
                seen = torch.ones(num_new, start + num_new, dtype=torch.bool)  # (T, S)
                seen[:, start:] = local
            mask = torch.zeros(seen.shape, dtype=self.dtype).masked_fill(~seen, torch.finfo(self.dtype).min)
            mask = mask[None, None]  # (1, 1, T, S)
        device = self.device
        out = self.model(
            input_ids=input_ids.to(device), past_key_values=cache.cache, use_cache=True,
            position_ids=(slots if positions is None else positions).unsqueeze(0).to(device),
            cache_position=slots.to(device), attention_mask=None if mask is None else mask.to(device),
            output_hidden_states=return_hidden,
            **({"logits_to_keep": logits_to_keep} if logits_to_keep and self._keeps_logits else {}),
        )
        logits = out.logits.float()  # (B, T, V), or (B, k, V) when the model took logits_to_keep
        if logits_to_keep > 0:
            logits = logits[:, -logits_to_keep:]  # (B, k, V) either way
        if not return_hidden:
            return logits.cpu()
        if hidden_layers is not None:  # (B, T, k*D): the residual stream entering each given layer
            return logits.cpu(), torch.cat([out.hidden_states[int(i)] for i in hidden_layers], dim=-1).cpu()
        return logits.cpu(), out.hidden_states[-1].cpu()  # (B, T, D), final-normed
