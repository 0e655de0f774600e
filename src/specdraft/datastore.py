"""Build a REST datastore (He et al. 2023, arXiv 2311.08252) from a text corpus: ``specdraft build-datastore``.

The index and its on-disk format live in :mod:`specdraft.datastore_index` (what the REST drafter reads); this module
adds the corpus side (ShareGPT or local files, :mod:`specdraft.corpus`) and re-exports the index's names.
"""

from __future__ import annotations

import time
from itertools import islice
from pathlib import Path

from specdraft.datastore_index import (
    DEFAULT_SOURCE,
    FILES,
    FORMAT,
    MANIFEST,
    SEPARATOR,
    VERSION,
    Datastore,
    default_dir,
    join_documents,
    load,
    save,
    suffix_array,
)
from specdraft.errors import SpecdraftError


def build(tokenizer, source: str = DEFAULT_SOURCE, out: str | Path | None = None,
          max_docs: int | None = None) -> tuple[Path, dict]:
    """Tokenise a corpus with the target's tokenizer, index it and save it; returns (folder, manifest).

    Args:
        source: ``"sharegpt"`` (assistant turns of the ShareGPT *train* split: held-out conversations stay out) or
            a .txt / .jsonl path (:func:`specdraft.corpus.text_source`).
        out: the folder; default :func:`default_dir`.
        max_docs: only the first N documents.
    """
    from specdraft.compat import tokenizer_fingerprint
    from specdraft.corpus import text_source, tokenize_documents

    if max_docs is not None and max_docs < 1:
        raise SpecdraftError(f"max_docs must be at least 1, got {max_docs}")
    fingerprint = tokenizer_fingerprint(tokenizer)
    out = Path(out).expanduser() if out is not None else default_dir(source, fingerprint)
    started = time.perf_counter()
    tokens, count = join_documents(tokenize_documents(tokenizer, islice(text_source(source), max_docs)))
    if count == 0:
        raise SpecdraftError(f"source {source!r} has no non-empty documents")
    tokenized = time.perf_counter()
    index = suffix_array(tokens)
    info = {"tokenizer_fingerprint": fingerprint, "source": source, "max_docs": max_docs, "documents": count,
            "tokens": int(tokens.size), "tokenize_seconds": round(tokenized - started, 3),
            "index_seconds": round(time.perf_counter() - tokenized, 3)}
    info["build_seconds"] = round(time.perf_counter() - started, 3)
    return out, save(Datastore(tokens, index, info), out)


__all__ = [
    "DEFAULT_SOURCE", "FILES", "FORMAT", "MANIFEST", "SEPARATOR", "VERSION", "Datastore", "build", "default_dir",
    "join_documents", "load", "save", "suffix_array",
]
