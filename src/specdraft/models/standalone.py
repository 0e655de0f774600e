"""Standalone copies of drafters that share their target's token embeddings.

A drafter saved with ``shared_embeddings.json`` (:mod:`specdraft.models.shared_embeddings`) has no embedding table
of its own, so transformers, llama.cpp and vLLM cannot load it. :func:`write_standalone` writes a copy of such a
folder with the target's table (V, D) put back under ``model.embed_tokens.weight``: a plain checkpoint that
``AutoModelForCausalLM.from_pretrained`` loads with no warning. :func:`shipped_standalone` makes that copy once for
a drafter shipped inside the package (in the cache folder, atomically) and is what the shipped name resolves to.

Folders are never left half-written: everything goes into a temporary folder beside the destination, which is
renamed into place at the end (an older copy is moved aside first, then deleted).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from specdraft.errors import SpecdraftError
from specdraft.files import build_folder
from specdraft.models.shared_embeddings import (
    EMBEDDING_KEY,
    FINGERPRINT_RTOL,
    SHARED_EMBEDDINGS_FILE,
    fingerprint,
    shared_embeddings,
)

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SOURCE_FILE = "specdraft_source.json"  # what a materialised copy was made from (to notice a changed package)
OPTIONS_FILE = "drafter_options.json"  # specdraft's default options for the drafter (drafters.options)
_SKIP = {SHARED_EMBEDDINGS_FILE, WEIGHTS_FILE, SOURCE_FILE, INDEX_FILE}


def check_table(folder: Path, table: torch.Tensor, target_name: str) -> None:
    """Refuse a (V, D) table that is not the one the shared-embeddings drafter in ``folder`` was trained with."""
    record = shared_embeddings(folder)
    if record is None:
        return
    if list(table.shape) != record["shape"]:
        raise SpecdraftError(f"drafter {folder} shares the embeddings of {record['target']!r}, shape "
                             f"{record['shape']}; target {target_name!r} has {list(table.shape)}")
    if not torch.allclose(torch.tensor(fingerprint(table)), torch.tensor(record["fingerprint"]), rtol=FINGERPRINT_RTOL):
        raise SpecdraftError(f"drafter {folder} was trained with the embeddings of {record['target']!r}; target "
                             f"{target_name!r} has other embeddings (fingerprint mismatch)")


def standalone_tensors(folder: Path, table: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The drafter's tensors with the embedding table (V, D) included, in the dtype of its other weights."""
    from safetensors.torch import load_file

    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise SpecdraftError(f"{folder} holds no {WEIGHTS_FILE}")
    tensors = load_file(path)
    if shared_embeddings(folder) is None:
        return tensors
    if table is None:
        raise SpecdraftError(f"{folder} shares its target's embeddings: the target's table is needed")
    dtype = next(iter(tensors.values())).dtype if tensors else table.dtype
    tensors[EMBEDDING_KEY] = table.detach().to("cpu", dtype).contiguous()
    return tensors


def read_options(folder: Path) -> dict | None:
    """The JSON object in a folder's ``drafter_options.json`` (None when absent)."""
    path = Path(folder) / OPTIONS_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise SpecdraftError(f"corrupt {path}: {exc}") from None


def standalone_card(card: str, target: str, options: dict | None) -> str:
    """The model card of a standalone copy: the original card, then what the copy holds and how to use it."""
    lines = [card.rstrip(), "", "## This folder", "",
             "A standalone checkpoint. Where the text above says the embedding table is not stored, this copy differs: "
             "the token", f"embedding table of `{target}` (and so a tied LM head) is in `model.safetensors`, so "
             "`AutoModelForCausalLM.from_pretrained(folder)`", "loads it on its own and transformers can use it as "
             "`assistant_model`:", "",
             "```python", "out = target.generate(ids, assistant_model=AutoModelForCausalLM.from_pretrained(folder))",
             "```", ""]
    if options:
        lines += ["`drafter_options.json` holds the options specdraft runs this drafter with by default, "
                  f"`{json.dumps(options)}`:",
                  "`draft_vocab` drafts from the most frequent tokens of the training responses only "
                  "(their ranking is `token_ranking.safetensors`),",
                  "`confidence_threshold` stops a draft when the draft model's top probability falls below it,",
                  "`quantize` drafts from weights rounded to int8 blocks where specdraft's int8 kernels run,",
                  "`prompt_lookup` / `prompt_lookup_alone` combine the draft with prompt lookup. Other engines "
                  "ignore the file: there the", "drafter drafts from the full vocabulary, a fixed number of tokens.",
                  ""]
    return "\n".join(lines)


def write_weights_index(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Name ``model.safetensors`` as the folder's only weights file (``model.safetensors.index.json``) when other
    ``*.safetensors`` files lie beside it (the token ranking of ``draft_vocab``): engines that load every
    safetensors file of a folder without an index (vLLM) then read the weights alone; transformers and specdraft
    read ``model.safetensors`` first either way."""
    if not any(p.name != WEIGHTS_FILE for p in Path(folder).glob("*.safetensors")):
        return
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": size}, "weight_map": {name: WEIGHTS_FILE for name in sorted(tensors)}}
    (Path(folder) / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n")


def write_standalone(folder: Path, table: torch.Tensor | None, out: Path, card: str | None = None,
                     source: dict | None = None) -> Path:
    """Write a copy of the checkpoint ``folder`` that holds its own embedding table to ``out`` (atomically).

    Args:
        folder: a checkpoint folder, with ``shared_embeddings.json`` or already standalone.
        table: (V, D) the target's embedding table (checked against the folder's fingerprint); None for a
            standalone folder.
        out: destination folder (an existing one is replaced only once the new copy is complete).
        card: README.md text (default: the folder's own).
        source: written as ``specdraft_source.json`` (what the copy was made from).
    """
    from safetensors.torch import save_file

    folder, out = Path(folder), Path(out)
    if table is not None:
        check_table(folder, table, str(source or ""))
    tensors = standalone_tensors(folder, table)

    def fill(tmp: Path) -> None:
        for path in folder.iterdir():
            if path.is_file() and path.name not in _SKIP:
                shutil.copy2(path, tmp / path.name)
        save_file(tensors, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
        write_weights_index(tmp, tensors)
        if card is not None:
            (tmp / "README.md").write_text(card)
        if source is not None:
            (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=1) + "\n")

    return build_folder(out, fill)


def checkpoint_table(folder: Path) -> torch.Tensor:
    """The embedding table (V, D) stored in a checkpoint folder's safetensors (one file or shards)."""
    from safetensors import safe_open

    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            if EMBEDDING_KEY in f.keys():
                return f.get_tensor(EMBEDDING_KEY)
    raise SpecdraftError(f"no {EMBEDDING_KEY} in the checkpoint at {folder}")


def folder_digest(folder: Path) -> str:
    """sha256 (16 hex digits) of a folder's file names, sizes and modification times (cheap enough to check on
    every resolve; a reinstalled or edited package changes it)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(folder).iterdir() if p.is_file()):
        stat = path.stat()
        digest.update(f"{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def shipped_standalone(name: str, folder: Path, out: Path, resolve_target: Callable[[str], Path]) -> Path:
    """The standalone copy at ``out`` of the shipped drafter in ``folder``, made on first use (and again when the
    shipped files change) with the embedding table of the target named in its ``shared_embeddings.json``."""
    record = shared_embeddings(folder)
    if record is None:
        return folder
    source = {"shipped": name, "digest": folder_digest(folder), "target": record["target"]}
    marker = out / SOURCE_FILE
    if marker.is_file():
        try:
            if json.loads(marker.read_text()) == source:
                return out
        except (OSError, ValueError):
            pass
    table = checkpoint_table(resolve_target(record["target"]))
    card_path = folder / "README.md"
    card = card_path.read_text() if card_path.is_file() else f"# {name}\n"
    card = standalone_card(card, record["target"], read_options(folder))
    return write_standalone(folder, table, out, card=card, source=source)
