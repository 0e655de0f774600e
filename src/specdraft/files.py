"""Files and folders of a run: written so that a crash never leaves one that looks complete (build it beside, then
rename), owned by one writer at a time (:func:`owning`), cleared of what a killed write left (:func:`remove_leftovers`),
and read so that a folder or bytes that are not UTF-8 are named in one line (:func:`text_lines`, :func:`read_text`).
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import os
import re
import shutil
import socket
import tempfile
import time
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
    """(line number from 1, line) of a UTF-8 text file (a ``.gz`` file through gzip); a folder, or a line that is not
    UTF-8, is a SpecdraftError naming the file and line (a missing or unreadable file raises ``OSError``, which names
    it)."""
    path = _not_a_folder(Path(path))
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as file:
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


# --- owning a run folder ---------------------------------------------------------------------------------------------

_LEFTOVER = re.compile(r"^\..+\.(tmp|old-\d+)$")  # write_text_atomic, mkstemp/mkdtemp(.tmp), replace_folder
_HELD: dict[Path, int] = {}  # lock file -> how many nested owning() of this process hold it


def lock_path(folder: str | Path) -> Path:
    """The lock file of a run folder: ``.NAME.lock`` beside it, so that it also covers the staging and old folders
    of a replacement (``.NAME.staging``, ``.NAME.old``) and survives the swap."""
    folder = Path(folder).resolve()
    return folder.with_name(f".{folder.name}.lock")


@contextlib.contextmanager
def owning(folder: str | Path, on_stale: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold the advisory lock (``flock``) of a run folder while the block runs: a second writer of the same folder,
    in another process, is refused with one line naming the holder. The lock goes with its process, so a run killed
    with -9 leaves only a stale lock file, which the next run takes over (telling ``on_stale``); a released lock
    file is deleted. Nested calls in one process share the lock. Where the file system has no locks, the block runs
    unlocked."""
    lock = lock_path(folder)
    if lock in _HELD:
        _HELD[lock] += 1
        try:
            yield
        finally:
            _HELD[lock] -= 1
        return
    fd = _acquire(lock, Path(folder), on_stale)
    _HELD[lock] = 1
    try:
        yield
    finally:
        del _HELD[lock]
        if fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(lock)  # before unlocking: a process that opened this file sees it gone and opens anew
            os.close(fd)


def _acquire(lock: Path, folder: Path, on_stale: Callable[[str], None] | None) -> int | None:
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd) or "a process that is starting"
            os.close(fd)
            raise SpecdraftError(f"{folder} is being written by another run ({holder}; lock {lock}): wait for it "
                                 "to finish or stop it, or use another --out") from None
        except OSError:  # no locks on this file system
            os.close(fd)
            return None
        with contextlib.suppress(FileNotFoundError):
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                break
        os.close(fd)  # the holder released (and deleted) the file between our open and lock: open the new one
    stale = _holder(fd)
    if stale and on_stale is not None:
        on_stale(f"{folder}: the run that held it ({stale}) ended without releasing its lock (killed?); taken over")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
              .encode(), 0)
    return fd


def _holder(fd: int) -> str:
    return os.pread(fd, 200, 0).decode("utf-8", "replace").strip()


def remove_leftovers(folder: str | Path) -> list[str]:
    """Delete what killed writes left in ``folder`` (not in its subfolders, which may be other runs): temp files and
    folders ``.NAME.*.tmp`` and folders moved aside ``.NAME.old-PID``, never part of a result. Returns their names.
    Call it only while owning the folder (:func:`owning`): another writer's temp files look the same."""
    removed = sorted(path for path in Path(folder).iterdir() if _LEFTOVER.match(path.name))
    for path in removed:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return [path.name for path in removed]
