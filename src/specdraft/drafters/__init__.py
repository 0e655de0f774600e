"""Drafters, one file each behind :class:`~specdraft.drafters.base.Drafter`.

``NAMED_DRAFTERS`` maps the name of each drafter chosen by name (``--drafter NAME``) to its factory
``make(target, tokenizer, options) -> Drafter`` (options: ``KEY=VALUE`` strings, see
:mod:`specdraft.drafters.options`): prompt lookup, REST, Lookahead, SuffixDecoding and layer-skip need nothing
trained; Medusa, EAGLE and EAGLE-3 read heads trained on the target; GSD and BiLD (lossy, opt-in) run on a draft
model (``draft=NAME``, by default the target's shipped drafter). Draft models are built from a checkpoint with
:class:`DraftModelDrafter`, combined with prompt lookup, copies or runners-up by :mod:`specdraft.drafters.combined`.
Factories import their module lazily, so a drafter's dependencies load only when it is used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specdraft.drafters.base import EMPTY_DRAFT, Draft, Drafter, NoDrafter
from specdraft.drafters.combined import WithChainCopies, WithPromptLookup, WithSiblings, draft_model_drafter
from specdraft.drafters.draft_model import DraftModelDrafter
from specdraft.drafters.options import build, parse_options
from specdraft.drafters.prompt_lookup import PromptLookupDrafter

DrafterFactory = Callable[[Any, Any, dict[str, str]], Drafter]


def _prompt_lookup(target, tokenizer, options: dict[str, str]) -> Drafter:
    return build(PromptLookupDrafter, options)


def _layer_skip(target, tokenizer, options: dict[str, str]) -> Drafter:
    from specdraft.drafters.layer_skip import LayerSkipDrafter

    return build(LayerSkipDrafter, options, target=target, tokenizer=tokenizer, calibration=None)


def _lookahead(target, tokenizer, options: dict[str, str]) -> Drafter:
    from specdraft.drafters.lookahead import LookaheadDrafter

    return build(LookaheadDrafter, options)


def _rest(target, tokenizer, options: dict[str, str]) -> Drafter:
    from specdraft.drafters.rest import RESTDrafter

    return build(RESTDrafter, options, tokenizer=tokenizer, store=None)


def _suffix(target, tokenizer, options: dict[str, str]) -> Drafter:
    from specdraft.drafters.suffix import SuffixDrafter

    return build(SuffixDrafter, options)


def _gsd(target, tokenizer, options: dict[str, str]) -> Drafter:
    """GSD on a draft model (``draft=NAME``, default: the target's shipped drafter)."""
    from specdraft.drafters.graph import GraphDrafter

    return _on_draft_model(GraphDrafter, "gsd", target, tokenizer, options)


def _bild(target, tokenizer, options: dict[str, str]) -> Drafter:
    """BiLD (lossy) with a draft model as its small model (``draft=NAME``, default: the target's shipped drafter)."""
    from specdraft.drafters.bild import BiLDDrafter

    return _on_draft_model(BiLDDrafter, "bild", target, tokenizer, options)


def _on_draft_model(factory, method: str, target, tokenizer, options: dict[str, str]) -> Drafter:
    """``factory(model=..., name=..., keep=..., **options)`` on the draft model ``options`` names, loaded in the
    target's dtype with its folder's ``quantize`` and ``draft_vocab``."""
    import torch

    from specdraft.drafters.draft_models import default_draft_model, draft_model_parts

    draft, merged = default_draft_model(target, options, method)
    dtype = getattr(target, "dtype", torch.float32)
    model, keep, rest = draft_model_parts(target, tokenizer, draft, dtype, "auto", merged, options)
    return build(factory, rest, model=model, name=f"{method}:{draft}", keep=keep)


def _medusa(target, tokenizer, options: dict[str, str]) -> Drafter:
    from specdraft.drafters.medusa import MedusaDrafter
    from specdraft.errors import SpecdraftError

    if "heads" not in options:
        raise SpecdraftError("medusa needs --drafter-option heads=PATH (a folder made by `specdraft train-heads`)")
    return build(MedusaDrafter, _with_folder_defaults(options))


def _eagle(target, tokenizer, options: dict[str, str]) -> Drafter:
    from specdraft.drafters.eagle import EagleDrafter
    from specdraft.errors import SpecdraftError

    if "heads" not in options:
        raise SpecdraftError("eagle needs --drafter-option heads=PATH (a folder made by `specdraft train-heads "
                             "--kind eagle`)")
    return build(EagleDrafter, _with_folder_defaults(options))


def _eagle3(target, tokenizer, options: dict[str, str]) -> Drafter:
    """EAGLE-3 with ``heads=PATH``, or without it the heads shipped for the target (SmolLM2-135M-Instruct:
    ``smollm2-135m-instruct-eagle3``)."""
    from specdraft.drafters.eagle3 import Eagle3Drafter
    from specdraft.models.registry import default_heads

    if "heads" not in options:
        options = {"heads": default_heads("eagle3", getattr(target, "name", ""))} | options
    return build(Eagle3Drafter, _with_folder_defaults(options))


def _glide(target, tokenizer, options: dict[str, str]) -> Drafter:
    from specdraft.drafters.glide import GlideDrafter
    from specdraft.errors import SpecdraftError

    if "heads" not in options:
        raise SpecdraftError("glide needs --drafter-option heads=PATH (a folder made by `specdraft train-heads "
                             "--kind glide`)")
    return build(GlideDrafter, _with_folder_defaults(options))


def _with_folder_defaults(options: dict[str, str]) -> dict[str, str]:
    """``options`` over the defaults shipped in the heads folder (``drafter_options.json``), if any."""
    from specdraft.drafters.options import folder_options
    from specdraft.models.registry import resolve_heads

    return folder_options(resolve_heads(options["heads"])) | options


NAMED_DRAFTERS: dict[str, DrafterFactory] = {
    "prompt-lookup": _prompt_lookup,
    "layer-skip": _layer_skip,
    "lookahead": _lookahead,
    "rest": _rest,
    "suffix": _suffix,
    "gsd": _gsd,
    "bild": _bild,
    "eagle": _eagle,
    "eagle3": _eagle3,
    "medusa": _medusa,
    "glide": _glide,
}

__all__ = [
    "EMPTY_DRAFT",
    "NAMED_DRAFTERS",
    "Draft",
    "DraftModelDrafter",
    "Drafter",
    "DrafterFactory",
    "NoDrafter",
    "PromptLookupDrafter",
    "WithChainCopies",
    "WithPromptLookup",
    "WithSiblings",
    "draft_model_drafter",
    "parse_options",
]
