"""Exports of a drafter for the engines users serve with: ``hf`` (a standalone transformers checkpoint), ``gguf``
(a llama.cpp draft model), ``speculators`` (vLLM's speculators format), ``eagle3`` (EAGLE-3 heads in the layout of vLLM,
SGLang and llama.cpp's converter), ``eagle3-gguf`` (EAGLE-3 heads as a llama.cpp GGUF), ``dflash-gguf`` (DFlash
heads as a llama.cpp GGUF). Each format registers itself in :data:`FORMATS`; :func:`export` runs one."""

from specdraft.export import dflash_gguf, eagle3, eagle3_gguf, gguf, hf, speculators
from specdraft.export.base import FORMATS, CheckedDrafter, ExportConfig, export, register

__all__ = ["FORMATS", "CheckedDrafter", "ExportConfig", "dflash_gguf", "eagle3", "eagle3_gguf", "export", "gguf",
           "hf", "register", "speculators"]
