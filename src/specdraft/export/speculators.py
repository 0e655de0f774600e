"""``--format speculators``: vLLM's speculators format for an independent draft model.

The folder is the ``hf`` export with a speculators ``config.json``: the drafter's own config (so transformers still
loads it) plus ``speculators_model_type: "independent"`` and a ``speculators_config`` naming the algorithm, its
token proposal (greedy, γ draft tokens) and the verifier (the target's hub id and architectures). The schema
follows the ``speculators`` package (version 0.4.0, the last with independent draft models):
:func:`check_config` checks it here, and ``tools/check_speculators.py`` loads the folder with that package's own
loader in its separate environment (``make engines``).
"""

from __future__ import annotations

import json
from pathlib import Path

from specdraft.errors import SpecdraftError
from specdraft.export.base import CheckedDrafter, ExportConfig, register
from specdraft.export.hf import export_hf

SPECULATORS_VERSION = "0.4.0"
ALGORITHM = "independent"


def verifier(target_name: str) -> dict:
    """The verifier entry: the target's hub id (the built-in's source model) and its architectures."""
    from transformers import AutoConfig

    from specdraft.models.registry import BUILTINS, resolve

    builtin = BUILTINS.get(target_name)
    name = builtin.hub_id if builtin is not None else target_name
    architectures = AutoConfig.from_pretrained(resolve(target_name), local_files_only=True).architectures or []
    return {"name_or_path": name, "architectures": list(architectures)}


def speculators_config(drafter_config: dict, target_name: str, num_draft_tokens: int) -> dict:
    """The drafter's config.json with the speculators fields added."""
    proposal = {"proposal_type": "greedy", "speculative_tokens": num_draft_tokens, "verifier_accept_k": 1,
                "accept_tolerance": 0.0}
    return drafter_config | {
        "speculators_model_type": ALGORITHM,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {"algorithm": ALGORITHM, "proposal_methods": [proposal],
                               "default_proposal_method": "greedy", "verifier": verifier(target_name)},
    }


def check_config(config: dict) -> None:
    """Check a speculators config.json against the schema of the speculators package (raises SpecdraftError)."""

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise SpecdraftError(f"speculators config: {what}")

    need(config.get("speculators_model_type") == ALGORITHM, f"speculators_model_type must be {ALGORITHM!r}")
    need(isinstance(config.get("model_type"), str), "model_type (the draft architecture) is missing")
    spec = config.get("speculators_config")
    need(isinstance(spec, dict), "speculators_config must be an object")
    need(spec.get("algorithm") == ALGORITHM, f"algorithm must be {ALGORITHM!r}")
    methods = spec.get("proposal_methods")
    need(isinstance(methods, list) and len(methods) > 0, "proposal_methods must be a non-empty list")
    for method in methods:
        need(isinstance(method, dict) and method.get("proposal_type") == "greedy", "proposal_type must be 'greedy'")
        k = method.get("speculative_tokens")
        need(isinstance(k, int) and k >= 1, "speculative_tokens must be an integer >= 1")
    need(spec.get("default_proposal_method") in {m["proposal_type"] for m in methods},
         "default_proposal_method must name one of proposal_methods")
    ver = spec.get("verifier")
    need(isinstance(ver, dict), "verifier must be an object")
    need(ver.get("name_or_path") is None or isinstance(ver["name_or_path"], str), "verifier.name_or_path: a string")
    need(isinstance(ver.get("architectures"), list) and all(isinstance(a, str) for a in ver["architectures"]),
         "verifier.architectures must be a list of strings")


@register("speculators")
def export_speculators(config: ExportConfig, drafter: CheckedDrafter) -> Path:
    from specdraft.files import build_folder

    if drafter.config.get("speculators_model_type"):
        raise SpecdraftError(f"{drafter.name} is already a speculators model")
    spec = speculators_config(drafter.config, drafter.target_name, config.num_draft_tokens)
    check_config(spec)
    out = Path(config.out).expanduser()

    def fill(tmp: Path) -> None:
        inner = export_hf(ExportConfig(config.drafter, "hf", str(tmp / "hf")), drafter)
        for path in inner.iterdir():
            path.rename(tmp / path.name)
        inner.rmdir()
        (tmp / "config.json").write_text(json.dumps(spec, indent=2) + "\n")

    return build_folder(out, fill)
