"""One exception type for every user-facing problem.

The CLI turns a :class:`SpecdraftError` into one line on stderr and exit code 2; library callers catch it
like any ``ValueError``.
"""

from __future__ import annotations


class SpecdraftError(ValueError):
    """Bad input or an unusable model/checkpoint, with a message that names the problem."""


def json_error(exc) -> str:
    """A ``json.JSONDecodeError`` as "what, where": ``Invalid control character at line 1 column 9`` (its ``msg``
    alone can end in a dangling "at")."""
    what = exc.msg.removesuffix(" at").removesuffix(":")
    return f"{what} at line {exc.lineno} column {exc.colno}"
