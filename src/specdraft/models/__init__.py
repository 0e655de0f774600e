"""Models: the :class:`CausalLM` interface, the native Llama fast path, the transformers adapter, the loader."""

from specdraft.models.base import CausalLM, KVCache
from specdraft.models.registry import BUILTINS, load_model, load_tokenizer

__all__ = ["BUILTINS", "CausalLM", "KVCache", "load_model", "load_tokenizer"]
