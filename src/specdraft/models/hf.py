"""Any transformers causal LM behind the :class:`~specdraft.models.base.CausalLM` interface.

Rollback uses ``DynamicCache.crop``, as transformers' own assisted generation does. This is the path for
architectures the native implementation does not cover.
"""

from __future__ import annotations

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


class HFCausalLM:
    """Adapter from a transformers ``PreTrainedModel`` to :class:`CausalLM`."""

    def __init__(self, model: PreTrainedModel, name: str = "") -> None:
        self.model = model.eval()
        self.config = model.config
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_context = int(getattr(model.config, "max_position_embeddings", 1 << 30) or 1 << 30)
        self.dtype = model.dtype

    def new_cache(self, capacity: int, batch_size: int = 1) -> HFCache:
        return HFCache(capacity, self.config)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: HFCache) -> torch.Tensor:
        start, num_new = cache.length, input_ids.shape[1]
        if start + num_new > cache.capacity:
            raise SpecdraftError(f"KV cache capacity {cache.capacity} exceeded ({start} + {num_new} positions)")
        positions = torch.arange(start, start + num_new).unsqueeze(0)  # (1, T)
        out = self.model(
            input_ids=input_ids, past_key_values=cache.cache, use_cache=True, position_ids=positions,
            cache_position=positions[0],
        )
        return out.logits.float()  # (B, T, V)
