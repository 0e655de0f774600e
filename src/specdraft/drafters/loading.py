"""Build a drafter by name: a draft model folder or name (checked against the target), or a drafter from
:data:`specdraft.drafters.NAMED_DRAFTERS`."""

from __future__ import annotations

import torch

from specdraft.drafters import NAMED_DRAFTERS, Drafter, draft_model_drafter
from specdraft.drafters.draft_models import draft_model_parts, draft_model_path
from specdraft.drafters.options import build, folder_options
from specdraft.errors import SpecdraftError
from specdraft.models import CausalLM


def load_drafter(
    target: CausalLM,
    target_tokenizer,
    draft: str | None = None,
    drafter: str | None = None,
    dtype: torch.dtype = torch.float32,
    backend: str = "auto",
    options: dict[str, str] | None = None,
) -> Drafter | None:
    """A drafter from a draft model name/path (checked for compatibility; its options are
    :func:`~specdraft.drafters.combined.draft_model_drafter`'s: ``tree_branching``, ``tree_nodes`` turn on its tree
    mode, ``prompt_lookup`` and the others combine it with copies) or a named drafter, with ``options``
    (``{KEY: VALUE}`` strings). A draft model folder may hold ``drafter_options.json``, the options it was measured
    best with (e.g. the shipped drafter's ``draft_vocab`` and ``confidence_threshold``); given options override
    them. ``quantize=int8`` or ``int4`` runs a native Llama draft model on block-quantized weights (its draft
    vocabulary's head rows too): drafting gets cheaper, acceptance may move, the target's output never changes."""
    if draft and drafter:
        raise SpecdraftError("give either a draft model (--draft) or a drafter by name (--drafter), not both")
    if drafter:
        if drafter not in NAMED_DRAFTERS:
            raise SpecdraftError(f"unknown drafter {drafter!r}; known: {', '.join(sorted(NAMED_DRAFTERS))}")
        return NAMED_DRAFTERS[drafter](target, target_tokenizer, dict(options or {}))
    if not draft:
        if options:
            raise SpecdraftError("drafter options need a drafter (--draft or --drafter)")
        return None
    given = dict(options or {})
    options = folder_options(draft_model_path(draft)) | given
    model, keep, options = draft_model_parts(target, target_tokenizer, draft, dtype, backend, options, given)
    return build(draft_model_drafter, options, model=model, name=f"draft:{draft}", keep=keep)
