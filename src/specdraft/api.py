"""The Python API in a few calls: load a target and a drafter by name, encode a prompt, generate.

    target, tokenizer = load_target("smollm2-135m-instruct")
    drafter = load_drafter(target, tokenizer, draft="path/to/drafter")   # or drafter="prompt-lookup"
    ids = encode_prompt(tokenizer, "Why is the sky blue?", chat=True)
    result = generate(target, ids, drafter, GenerationConfig(eos_token_ids=eos_token_ids(tokenizer)))

A thin front: every name here is defined in the module that owns it, and no module of the package imports this one.
"""

from __future__ import annotations

from specdraft.decoding import generate
from specdraft.drafters.loading import load_draft_model
from specdraft.drafters.registry import load_drafter
from specdraft.models.registry import DTYPES, eos_token_ids, load_target, parse_dtype
from specdraft.prompts import encode_prompt
from specdraft.sequence import GenerationConfig, GenerationResult

__all__ = [
    "DTYPES", "GenerationConfig", "GenerationResult", "encode_prompt", "eos_token_ids", "generate",
    "load_draft_model", "load_drafter", "load_target", "parse_dtype",
]
