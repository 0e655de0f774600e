"""The drafters chosen by name, and the one entry that builds any drafter (:func:`load_drafter`).

A drafter class that declares a ``method`` name is found by it: ``specdraft generate --drafter NAME``,
``specdraft bench --methods NAME``, ``serve --drafter NAME`` and ``load_drafter(drafter=NAME)``. The registry
(:data:`NAMED_DRAFTERS`, name -> class) is every such class in the modules of this package, collected on first use,
so adding a drafter is adding its file (and its test): the class declares

- ``method``: its name;
- ``facts``: what the tools need to know of it (:class:`~specdraft.drafters.base.DrafterFacts`);
- optionally ``from_options(target, tokenizer, options) -> Drafter``, when its ``KEY=VALUE`` options are more than
  its constructor's keyword parameters (:func:`~specdraft.drafters.options.build`), e.g. a heads folder to load.

Draft models are not chosen by name but by their folder (``--draft``):
:func:`~specdraft.drafters.combined.draft_model_drafter` builds them with the options they name.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Iterator, Mapping

import torch

from specdraft.drafters.base import Drafter
from specdraft.drafters.combined import CHAIN_OPTIONS, draft_model_drafter
from specdraft.drafters.loading import draft_model_parts, draft_model_path
from specdraft.drafters.ngram import open_table
from specdraft.drafters.options import build, folder_options
from specdraft.errors import SpecdraftError
from specdraft.models import CausalLM


class Registry(Mapping[str, type]):
    """Name -> drafter class, for every class of a module in :mod:`specdraft.drafters` (or another folder on its
    ``__path__``) that declares a ``method`` of its own; collected on first use, again after :meth:`refresh`."""

    def __init__(self) -> None:
        self._classes: dict[str, type] | None = None

    def refresh(self) -> None:
        """Forget what was collected: the next use looks again (a drafter file added at run time)."""
        self._classes = None

    def _collect(self) -> dict[str, type]:
        if self._classes is None:
            found: dict[str, type] = {}
            package = sys.modules[__name__.rpartition(".")[0]]  # specdraft.drafters, initialised before its modules
            for module in sorted(info.name for info in pkgutil.iter_modules(package.__path__)):
                loaded = importlib.import_module(f"{package.__name__}.{module}")
                for value in vars(loaded).values():
                    if isinstance(value, type) and value.__module__ == loaded.__name__ and "method" in vars(value):
                        if value.method in found and found[value.method] is not value:
                            raise SpecdraftError(f"two drafters are named {value.method!r}: "
                                                 f"{found[value.method].__qualname__} and {value.__qualname__}")
                        found[value.method] = value
            self._classes = found
        return self._classes

    def __getitem__(self, name: str) -> type:
        return self._collect()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._collect()))

    def __len__(self) -> int:
        return len(self._collect())


NAMED_DRAFTERS = Registry()


def make_named(name: str, target: CausalLM, tokenizer, options: dict[str, str] | None = None) -> Drafter:
    """The drafter named ``name`` with ``options`` (``{KEY: VALUE}`` strings)."""
    if name not in NAMED_DRAFTERS:
        raise SpecdraftError(f"unknown drafter {name!r}; known: {', '.join(NAMED_DRAFTERS)}")
    cls = NAMED_DRAFTERS[name]
    options = dict(options or {})
    if hasattr(cls, "from_options"):
        return cls.from_options(target, tokenizer, options)
    return build(cls, options)


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
    them, and where they ask for trees (``tree_branching``) the folder's options for chains (:data:`CHAIN_OPTIONS`)
    are left out unless given too. ``quantize=int8`` or ``int4`` runs a native Llama draft model on block-quantized
    weights (its draft vocabulary's head rows too): drafting gets cheaper, acceptance may move, the target's output
    never changes."""
    if draft and drafter:
        raise SpecdraftError("give either a draft model (--draft) or a drafter by name (--drafter), not both")
    if drafter:
        return make_named(drafter, target, target_tokenizer, options)
    if not draft:
        if options:
            raise SpecdraftError("drafter options need a drafter (--draft or --drafter)")
        return None
    given = dict(options or {})
    defaults = folder_options(draft_model_path(draft))
    if _asks_for_trees(given):  # the folder's defaults for its chains do not apply to the trees asked for
        defaults = {key: value for key, value in defaults.items() if key not in CHAIN_OPTIONS}
    options = defaults | given
    model, keep, options = draft_model_parts(target, target_tokenizer, draft, dtype, backend, options, given)
    table = options.pop("ngram_table", "")
    ngram = open_table(table, target_tokenizer) if table else None
    return build(draft_model_drafter, options, model=model, name=f"draft:{draft}", keep=keep, ngram=ngram)


def _asks_for_trees(options: Mapping[str, str]) -> bool:
    """Whether ``options`` set tree mode (``tree_branching`` > 0); a value that is not a number is left to the
    drafter's own check."""
    try:
        return int(options.get("tree_branching", "0")) > 0
    except ValueError:
        return False


__all__ = ["NAMED_DRAFTERS", "Registry", "load_drafter", "make_named"]
