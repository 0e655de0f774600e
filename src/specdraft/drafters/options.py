"""``KEY=VALUE`` options for training-free drafters (``--drafter-option`` in the CLI, ``NAME:k=v;k=v`` in bench).

A drafter's options are its constructor's keyword parameters; :func:`build` converts each string to the type of
the parameter's default (int, float, bool, str or path) and names the known options when a key is unknown.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from specdraft.errors import SpecdraftError

_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def parse_options(items: Iterable[str] | str | None) -> dict[str, str]:
    """``["k=v", ...]`` or ``"k=v;k=v"`` -> {k: v} (``-`` in keys becomes ``_``)."""
    if items is None:
        return {}
    if isinstance(items, str):
        items = [part for part in items.split(";") if part.strip()]
    options: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SpecdraftError(f"drafter option must be KEY=VALUE, got {item!r}")
        options[key.strip().replace("-", "_")] = value.strip()
    return options


def _convert(name: str, text: str, default: Any, annotation: Any) -> Any:
    kind = type(default) if default is not None and default is not inspect.Parameter.empty else annotation
    kind_name = getattr(kind, "__name__", str(kind))
    try:
        if kind is bool or kind_name == "bool":
            if text.lower() not in _TRUE | _FALSE:
                raise ValueError
            return text.lower() in _TRUE
        if kind is int or kind_name == "int":
            return int(text)
        if kind is float or kind_name == "float":
            return float(text)
        if isinstance(default, Path) or "Path" in str(annotation):
            return Path(text).expanduser()
    except ValueError:
        raise SpecdraftError(f"drafter option {name}={text!r}: expected {kind_name}") from None
    return text


def build(factory: Callable[..., Any], options: dict[str, str], **fixed: Any) -> Any:
    """Call ``factory(**fixed, **converted options)``; unknown option names are a clear error."""
    parameters = inspect.signature(factory).parameters
    settable = {n: p for n, p in parameters.items() if (n not in fixed and p.kind is p.POSITIONAL_OR_KEYWORD)
                or p.kind is p.KEYWORD_ONLY}
    unknown = sorted(set(options) - set(settable))
    if unknown:
        known = ", ".join(sorted(settable)) or "none"
        raise SpecdraftError(f"unknown drafter option {', '.join(unknown)}; this drafter takes: {known}")
    converted = {n: _convert(n, v, settable[n].default, settable[n].annotation) for n, v in options.items()}
    return factory(**fixed, **converted)


DRAFTER_OPTIONS_FILE = "drafter_options.json"


def folder_options(folder) -> dict[str, str]:
    """The default options a draft model or heads folder ships with (:data:`DRAFTER_OPTIONS_FILE`, a JSON object of
    the options it was measured best with), as ``{KEY: VALUE}`` strings; {} for none or a hub id."""
    import json

    path = Path(folder) / DRAFTER_OPTIONS_FILE if isinstance(folder, Path) else None
    if path is None or not path.is_file():
        return {}
    try:
        values = json.loads(path.read_text())
        if not isinstance(values, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        raise SpecdraftError(f"corrupt {path}: {exc}") from None
    return {str(k): str(v) for k, v in values.items()}
