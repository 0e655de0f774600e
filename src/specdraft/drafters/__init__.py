"""Drafters, one file each behind :class:`~specdraft.drafters.base.Drafter`.

Each drafter class declares what the tools need to know of it (``facts``: :class:`DrafterFacts`) and, when it is
chosen by name (``--drafter NAME``), that name (``method``): :data:`NAMED_DRAFTERS` collects them from this package's
files (:mod:`specdraft.drafters.registry`). Prompt lookup, REST, Lookahead, SuffixDecoding and layer-skip need
nothing trained; Medusa, EAGLE, EAGLE-3 and GliDe read heads trained on the target; GSD and BiLD (lossy, opt-in) run
on a draft model (``draft=NAME``, by default the target's shipped drafter). Draft models are built from a checkpoint
with :class:`DraftModelDrafter`, combined with prompt lookup, copies or runners-up by
:mod:`specdraft.drafters.combined`. :func:`load_drafter` builds any of them; :mod:`specdraft.drafters.loading` loads
the weights they draft with.
"""

from __future__ import annotations

from specdraft.drafters.base import EMPTY_DRAFT, Draft, Drafter, DrafterFacts, NoDrafter, facts_of
from specdraft.drafters.combined import WithChainCopies, WithPromptLookup, WithSiblings, draft_model_drafter
from specdraft.drafters.draft_model import DraftModelDrafter
from specdraft.drafters.options import parse_options
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.drafters.registry import NAMED_DRAFTERS, load_drafter

__all__ = [
    "EMPTY_DRAFT",
    "NAMED_DRAFTERS",
    "Draft",
    "DraftModelDrafter",
    "Drafter",
    "DrafterFacts",
    "NoDrafter",
    "PromptLookupDrafter",
    "WithChainCopies",
    "WithPromptLookup",
    "WithSiblings",
    "draft_model_drafter",
    "facts_of",
    "load_drafter",
    "parse_options",
]
