"""GGUF files of targets: where a target's GGUF is, and its tokenizer metadata (``tokenizer.*`` fields), which a
llama.cpp draft model must share with its target."""

from __future__ import annotations

from pathlib import Path

from specdraft.errors import SpecdraftError

TOKENIZER_PREFIX = "tokenizer."


def target_gguf_file(target: str, explicit: str | Path | None = None) -> Path:
    """The GGUF of ``target``: ``explicit`` when given, the built-in model's file, or the one .gguf in its folder."""
    from specdraft.models.registry import BUILTINS, gguf_file, resolve

    if explicit:
        path = Path(explicit).expanduser()
    else:
        folder = target if target in BUILTINS else resolve(target)
        path = gguf_file(str(folder)) if isinstance(folder, Path | str) else None
        if path is None:
            raise SpecdraftError(f"no GGUF file for target {target!r}: a built-in target, or a folder holding "
                                 "exactly one .gguf, or pass its GGUF file (--target-gguf)")
    if not path.is_file():
        raise SpecdraftError(f"target GGUF not found: {path}")
    return path


def tokenizer_fields(path: str | Path) -> dict[str, tuple]:
    """``{key: (value, [value type, item type])}`` of the ``tokenizer.*`` fields of a GGUF file."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise SpecdraftError(f"cannot read GGUF {path}: {exc}") from None
    return {k: (f.contents(), list(f.types)) for k, f in reader.fields.items() if k.startswith(TOKENIZER_PREFIX)}


def same_tokenizer(a: str | Path, b: str | Path, added: dict | None = None) -> bool:
    """Whether GGUF ``a`` carries the tokenizer metadata of ``b`` (with the ``added`` fields set on top)."""
    theirs = {k: v[0] for k, v in tokenizer_fields(b).items()} | (added or {})
    return {k: v[0] for k, v in tokenizer_fields(a).items()} == theirs
