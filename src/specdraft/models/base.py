"""The model interface every decoding path uses: a causal LM with an explicit, croppable KV cache.

Two implementations live beside this file: :mod:`specdraft.models.native_llama` (the fast path for the Llama
family, with a static position-indexed cache whose rollback is free) and :mod:`specdraft.models.hf` (any
transformers causal LM, whose ``DynamicCache`` is cropped on rollback).

The cache is an explicit argument (house style): a model never hides decoding state in an attribute.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class KVCache(Protocol):
    """Keys and values of the first ``length`` positions of one sequence batch."""

    @property
    def length(self) -> int:
        """Number of valid positions held."""
        ...

    @property
    def capacity(self) -> int:
        """Most positions this cache can hold."""
        ...

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` positions (rollback of rejected draft tokens)."""
        ...

    def compact(self, start: int, slots: list[int]) -> None:
        """Keep the first ``start`` positions, then the given slots (>= start, increasing) moved after them."""
        ...


@runtime_checkable
class ReadableKVCache(Protocol):
    """Optional capability of a :class:`KVCache`: read access to the keys and values it holds (GliDe's draft
    cross-attends to the target's cache, :mod:`specdraft.drafters.glide`). Slot p holds position p: a tree step's
    rollback (``compact``) moves the accepted nodes into place before anyone reads."""

    @property
    def length(self) -> int:
        ...

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of decoder layer ``layer`` (negative counts from the last) at the ``length`` valid
        positions, each (B, K, length, hd), keys with their rotary angles applied: views to read, never to write."""
        ...


@runtime_checkable
class CausalLM(Protocol):
    """A causal language model with an explicit cache.

    ``forward`` appends ``input_ids`` at positions ``cache.length ..`` and returns logits for every input position.
    """

    vocab_size: int  # width of the logits (may exceed the tokenizer's length)
    max_context: int  # most positions the model supports (max_position_embeddings)
    dtype: torch.dtype
    name: str

    def new_cache(self, capacity: int, batch_size: int = 1) -> KVCache:
        """An empty cache for up to ``capacity`` positions."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        positions: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        return_hidden: bool = False,
        logits_to_keep: int = 0,
        hidden_layers: Sequence[int] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits for ``input_ids``.

        Args:
            input_ids: (B, T) token ids, written to cache slots ``cache.length .. cache.length + T - 1``.
            cache: extended in place by T slots.
            positions: (T,) absolute positions, default the slots (a token tree gives its depths).
            attention_mask: (T, T) bool among the new tokens, default causal; cached slots are visible to all.
            return_hidden: also return the final-normed hidden states (B, T, D), the LM head's input.
            logits_to_keep: k > 0 computes logits for the last k positions only (a prefill needs at most one row;
                transformers' argument of that name); 0 = every position. Hidden states are never cut.
            hidden_layers: with ``return_hidden``, return instead the residual stream entering these layers
                (increasing indices), concatenated (B, T, k*D): EAGLE-3's features.

        Returns:
            (B, T, V) logits in float32, (B, k, V) with ``logits_to_keep`` = k.
        """
        ...
