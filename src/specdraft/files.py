"""Files and folders: written so that a crash never leaves one that looks complete (build it beside, then rename),
and read so that a folder or bytes that are not UTF-8 are named in one line (:func:`text_lines`, :func:`read_text`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from specdraft.errors import SpecdraftError, naming, utf8_error


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
    try:
        with open(tmp, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # an unwritable folder or a full disk: name the file meant, leave no temp file
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise naming(exc, path) from None


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


# --- reading -----------------------------------------------------------------------------------------------------


def _not_a_folder(path: Path) -> Path:
    if path.is_dir():
        raise SpecdraftError(f"{path} is a folder, not a file")
    return path


def text_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(line number from 1, line) of a UTF-8 text file; a folder, or a line that is not UTF-8, is a SpecdraftError
    naming the file and line (a missing or unreadable file raises ``OSError``, which names it)."""
    path = _not_a_folder(Path(path))
    with open(path, "rb") as file:
        for number, raw in enumerate(file, start=1):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise SpecdraftError(f"{path}:{number}: {utf8_error(exc, 'column')}") from None


def read_text(path: str | Path) -> str:
    """The text of a UTF-8 file, with the errors of :func:`text_lines`."""
    path = _not_a_folder(Path(path))
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise SpecdraftError(f"{path}: {utf8_error(exc)}") from None
