"""Convert a data folder of an older layout, whose ``manifest.json`` lists its shards without their checksums (an
older specdraft, or a manifest written by hand), to the layout every reader needs: each listed shard's record count
(``shards``) and sha256 (``sha256``), computed from the shards as they are.

    python tools/add_shard_checksums.py FOLDER [FOLDER ...]

The shards are trusted as they are: check them first (a shard cut short by a crash holds fewer records than the
manifest says, and is refused). The manifest is written beside and renamed; the rest of it is kept.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdraft.errors import SpecdraftError
from specdraft.files import write_text_atomic
from specdraft.training.runs.folders import MANIFEST_FILE, shard_entries


def add_checksums(folder: str | Path) -> dict:
    """Write ``folder``'s manifest with the record count and sha256 of every shard it lists; returns it."""
    folder, path = Path(folder), Path(folder) / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
        listed = manifest["shards"]
        if not isinstance(listed, (list, dict)):
            raise TypeError
    except (OSError, ValueError, TypeError, KeyError):
        raise SpecdraftError(f"{path} is missing or not a data folder's manifest") from None
    missing = [name for name in listed if not (folder / name).is_file()]
    if missing:
        raise SpecdraftError(f"{folder / missing[0]} is listed in {path} but missing: remove it from the list first")
    counts, sums = shard_entries(folder, sorted(listed))
    short = [name for name in counts if isinstance(listed, dict) and listed[name] not in (None, counts[name])]
    if short:
        raise SpecdraftError(f"{folder / short[0]} holds {counts[short[0]]} records, the manifest says "
                             f"{listed[short[0]]}: make the folder again")
    manifest |= {"shards": counts, "sha256": sums, "records": sum(counts.values())}
    write_text_atomic(path, json.dumps(manifest, indent=1))
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="data folders (distill-data, distill-topk) to convert")
    args = parser.parse_args(argv)
    try:
        for folder in args.folders:
            manifest = add_checksums(folder)
            print(f"{folder}: {len(manifest['shards'])} shards, {manifest['records']} records, checksums added")
    except SpecdraftError as exc:
        print(f"add_shard_checksums: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
