"""Check a ``specdraft export --format speculators`` folder with the ``speculators`` package's own code.

Runs in the separate environment ``make engines`` makes (``~/.cache/specdraft/engines/speculators-0.4.0``):
    ~/.cache/specdraft/engines/speculators-0.4.0/bin/python tools/check_speculators.py FOLDER

First the package's loader, ``SpeculatorModelConfig.from_pretrained(FOLDER)``. In speculators 0.4.0 that loader
fails for every independent draft model, its own ``IndependentSpeculatorConfig.from_pretrained_config`` included
(``AttributeError: 'model_type' is a ClassVar``, with pydantic 2.10-2.14 and transformers 4.56-4.57); on that known
failure the script falls back to the package's own schema: ``speculators_model_type`` must be registered, and
``speculators_config`` must validate as ``SpeculatorsConfig`` (algorithm, proposal methods, verifier).
Prints one JSON line and exits 0, or exits 1 with the package's error.
"""

import json
import sys
from pathlib import Path

KNOWN_LOADER_BUG = "'model_type' is a ClassVar"


def main(folder: str) -> int:
    from speculators import SpeculatorModelConfig, SpeculatorsConfig

    try:
        config = SpeculatorModelConfig.from_pretrained(folder)
        spec, checked = config.speculators_config, "loader"
    except AttributeError as exc:
        if KNOWN_LOADER_BUG not in str(exc):
            print(f"speculators refused {folder}: AttributeError: {exc}", file=sys.stderr)
            return 1
        raw = json.loads((Path(folder) / "config.json").read_text())
        kind = raw.get("speculators_model_type")
        if kind not in (SpeculatorModelConfig.registry or {}):
            print(f"speculators knows no speculators_model_type {kind!r}", file=sys.stderr)
            return 1
        try:
            spec, checked = SpeculatorsConfig.model_validate(raw["speculators_config"]), "schema"
        except Exception as err:  # pydantic's ValidationError, or a missing key
            print(f"speculators refused {folder}: {type(err).__name__}: {err}", file=sys.stderr)
            return 1
    except Exception as exc:  # the loader's own error, whatever its type, is the answer
        print(f"speculators refused {folder}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"checked_by": checked, "algorithm": spec.algorithm,
                      "default_proposal_method": spec.default_proposal_method,
                      "proposal_methods": [m.model_dump() for m in spec.proposal_methods],
                      "verifier": spec.verifier.model_dump()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
