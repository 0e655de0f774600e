"""Drafters, one file each behind :class:`~specdraft.drafters.base.Drafter`.

``TRAINING_FREE`` maps the CLI name of each drafter that needs no second model to its factory; draft models are
built from a checkpoint with :class:`DraftModelDrafter`.
"""

from collections.abc import Callable

from specdraft.drafters.base import EMPTY_DRAFT, Draft, Drafter, NoDrafter
from specdraft.drafters.draft_model import DraftModelDrafter
from specdraft.drafters.prompt_lookup import PromptLookupDrafter

TRAINING_FREE: dict[str, Callable[[], Drafter]] = {"prompt-lookup": PromptLookupDrafter}

__all__ = ["EMPTY_DRAFT", "TRAINING_FREE", "Draft", "DraftModelDrafter", "Drafter", "NoDrafter", "PromptLookupDrafter"]
