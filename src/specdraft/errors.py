"""One exception type for every user-facing problem, and the one-line descriptions of the environment's errors.

The CLI turns a :class:`SpecdraftError` into one line on stderr and exit code 2; library callers catch it
like any ``ValueError``. An ``OSError`` (a file that cannot be read or written, a folder where a file belongs, a full
disk) is the user's to fix too: the CLI describes it with :func:`os_error`, naming the file.
"""

from __future__ import annotations


class SpecdraftError(ValueError):
    """Bad input or an unusable model/checkpoint, with a message that names the problem."""


def json_error(exc) -> str:
    """A ``json.JSONDecodeError`` as "what, where": ``Invalid control character at line 1 column 9`` (its ``msg``
    alone can end in a dangling "at")."""
    what = exc.msg.removesuffix(" at").removesuffix(":")
    return f"{what} at line {exc.lineno} column {exc.colno}"


def os_error(exc: OSError) -> str:
    """An ``OSError`` as one line naming the file(s) and the problem: ``runs/x/train_log.csv: Permission denied``."""
    what = exc.strerror or str(exc) or type(exc).__name__
    if exc.filename is None:
        return what
    if exc.filename2 is not None:
        return f"{exc.filename} -> {exc.filename2}: {what}"
    return f"{exc.filename}: {what}"


def naming(exc: OSError, path) -> OSError:
    """``exc`` naming ``path``, the file meant, rather than the temp file it was being written through."""
    if exc.errno is None:
        return OSError(f"{path}: {exc}")
    exc.filename, exc.filename2 = str(path), None
    return exc


def utf8_error(exc: UnicodeDecodeError, where: str = "byte") -> str:
    """The first byte that is not UTF-8, counted from 1: ``not UTF-8 text (byte 0xe9 at column 16)`` with ``where``
    "column" for a decoded line."""
    return f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at {where} {exc.start + 1})"
