"""Self-drafting heads on a frozen target's features: Medusa (Cai et al. 2024, arXiv 2401.10774), EAGLE (Li et
al. 2024, arXiv 2401.15077), EAGLE-3, DFlash's block drafter (arXiv 2602.06036), and GliDe's draft model, which reads
the target's KV cache (Du et al. 2024, arXiv 2402.02082). This package holds the head architectures (one module per
kind) and their exported file format; training them (``specdraft train-heads --kind NAME``) lives in
:mod:`specdraft.training.heads.train_heads`.

``<out>/heads/`` holds ``heads.safetensors`` (the trainable weights only; the frozen target is never copied),
``heads.json`` (``{"format": 1, "kind": NAME, "spec": {...}, "target": NAME_OR_PATH}``) and a model card
``README.md``. :func:`save_heads` writes the folder atomically; :func:`load_heads` checks it and rebuilds the module
with the kind's builder (:func:`build_heads`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.files import build_folder

WEIGHTS_FILE = "heads.safetensors"
CONFIG_FILE = "heads.json"
FORMAT = 1


def _builders() -> dict[str, Callable[[dict], nn.Module]]:
    """Kind name -> build(spec) -> a fresh module; a new kind of heads adds its builder here."""
    from specdraft.heads.dflash import build_dflash
    from specdraft.heads.eagle import build_eagle
    from specdraft.heads.eagle3 import build_eagle3
    from specdraft.heads.glide import build_glide
    from specdraft.heads.medusa import build_medusa

    return {"medusa": build_medusa, "eagle": build_eagle, "eagle3": build_eagle3, "glide": build_glide,
            "dflash": build_dflash}


def build_heads(kind: str, spec: dict) -> nn.Module:
    """A fresh module of heads ``kind`` from its spec (``heads.json``'s ``spec``); an unknown kind is a clear error."""
    builders = _builders()
    if kind not in builders:
        raise SpecdraftError(f"unknown heads kind {kind!r}; known: {', '.join(sorted(builders))}")
    return builders[kind](spec)


def save_heads(module: nn.Module, kind: str, spec: dict, out: str | Path, target: str, card: str = "",
               dtype: torch.dtype = torch.float32, ranking: torch.Tensor | None = None) -> Path:
    """Write ``module``'s weights (floating tensors in ``dtype``; integer and bool buffers such as EAGLE-3's
    ``d2t`` / ``t2d`` as they are), ``heads.json``, ``README.md`` (``card``) and, if given, the training data's token
    ``ranking`` (:mod:`specdraft.draft_vocab`) to ``out``, replacing an old folder only once the new one is
    complete."""
    return build_folder(Path(out), lambda tmp: write_heads(tmp, module, kind, spec, target, card, dtype, ranking))


def write_heads(folder: Path, module: nn.Module, kind: str, spec: dict, target: str, card: str = "",
                dtype: torch.dtype = torch.float32, ranking: torch.Tensor | None = None) -> None:
    """The files of :func:`save_heads`, written into the existing (temporary) ``folder``."""
    from safetensors.torch import save_file

    weights = {k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous()
               for k, v in module.state_dict().items()}
    save_file(weights, str(folder / WEIGHTS_FILE))
    meta = {"format": FORMAT, "kind": kind, "spec": spec, "target": target}
    (folder / CONFIG_FILE).write_text(json.dumps(meta, indent=1, default=str) + "\n")
    (folder / "README.md").write_text(card or f"# specdraft {kind} heads\n\nTarget: `{target}`.\n")
    if ranking is not None:
        from specdraft.draft_vocab import save_token_ranking

        save_token_ranking(folder, ranking)


def read_heads_config(path: str | Path) -> dict:
    """``heads.json`` of a heads folder (or shipped heads by name), checked (format, kind, spec with vocab_size and
    hidden_size)."""
    from specdraft.models.registry import resolve_heads

    path = resolve_heads(str(path))
    try:
        meta = json.loads((path / CONFIG_FILE).read_text())
    except OSError:
        raise SpecdraftError(f"{path} is not a heads folder (no {CONFIG_FILE}); train one with "
                             "`specdraft train-heads`") from None
    except ValueError as exc:
        raise SpecdraftError(f"corrupt {path / CONFIG_FILE}: {exc}") from None
    spec = meta.get("spec") if isinstance(meta, dict) else None
    if (not isinstance(spec, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("kind"), str)
            or not all(isinstance(spec.get(k), int) for k in ("vocab_size", "hidden_size"))):
        raise SpecdraftError(f"{path / CONFIG_FILE} is not a format-{FORMAT} heads config (kind, spec)")
    return meta


def load_heads(path: str | Path, kind: str | None = None) -> tuple[dict, nn.Module]:
    """(``heads.json`` contents, the rebuilt module in eval mode on the CPU, fp32) from a folder written by
    :func:`save_heads`; a missing, truncated or foreign file, or another ``kind`` than asked, is a SpecdraftError."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from specdraft.models.registry import resolve_heads

    path = resolve_heads(str(path))
    meta = read_heads_config(path)
    if kind is not None and meta["kind"] != kind:
        raise SpecdraftError(f"{path} holds {meta['kind']} heads, not {kind} heads")
    module = build_heads(meta["kind"], meta["spec"])
    try:
        weights = load_file(str(path / WEIGHTS_FILE))
    except (OSError, SafetensorError, ValueError) as exc:
        raise SpecdraftError(f"corrupt heads weights {path / WEIGHTS_FILE}: {str(exc).splitlines()[0][:200]}") from None
    try:
        module.load_state_dict(weights)
    except RuntimeError as exc:
        raise SpecdraftError(f"{path / WEIGHTS_FILE} does not match {CONFIG_FILE}: "
                             f"{str(exc).splitlines()[0][:200]}") from None
    return meta, module.float().eval()


__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "build_heads", "load_heads", "read_heads_config", "save_heads", "write_heads"]
