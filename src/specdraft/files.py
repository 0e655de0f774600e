"""Writing folders so that a crash never leaves one that looks complete: build it beside, then rename."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_dir() -> Path:
    """specdraft's cache folder (converted checkpoints, cost curves, built kernels): ``$SPECDRAFT_CACHE`` or
    ``~/.cache/specdraft``."""
    return Path(os.environ.get("SPECDRAFT_CACHE", Path.home() / ".cache" / "specdraft"))


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


def usual_modes(folder: Path) -> None:
    """The modes a folder and files made by ``mkdir`` / ``open`` would get (mkdtemp and safetensors make 0700 and
    0600, which would hide a shipped drafter from the other users of a shared folder)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for path in folder.iterdir():
        if path.is_file():
            os.chmod(path, 0o666 & ~umask)


def build_folder(out: Path, fill: Callable[[Path], None]) -> Path:
    """Build a folder by ``fill(tmp)`` in a temporary folder beside ``out``, give it the usual modes, then rename it
    to ``out`` (:func:`replace_folder`). Returns ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        fill(tmp)
        usual_modes(tmp)
        replace_folder(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
