"""Writing folders so that a crash never leaves one that looks complete: build it beside, then rename."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def replace_folder(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an old ``out`` is first moved aside, then deleted."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, fsync it, then rename it over ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)
