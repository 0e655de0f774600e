"""Training checkpoints (for ``--resume``) and the Hugging Face export of a trained drafter (Goel et al. 2024).

Both are written so that a crash at any moment never leaves something that looks complete:

- a training checkpoint is one ``torch.save`` file written to a temp file in the same folder, fsynced, then
  ``os.replace``-d over the old one;
- an export is built in a temp folder beside its destination and renamed into place at the very end, so the
  destination folder exists only when ``config.json``, the weights, the tokenizer files, ``generation_config.json``
  and the model card ``README.md`` are all there.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
from pathlib import Path

import torch

from specdraft.errors import SpecdraftError, naming
from specdraft.files import build_folder
from specdraft.hardware import cpu_model, resolve_device
from specdraft.models.registry import DTYPES, load_tokenizer

CHECKPOINT_FILE = "checkpoint.pt"
REQUIRED_KEYS = ("model", "optimizer", "scheduler", "step", "rng", "data")
EXPORT_FILES = ("config.json", "model.safetensors", "generation_config.json", "README.md")
EXPORT_DTYPES = DTYPES  # float32 | bfloat16, the same names as --dtype


# --- training checkpoints --------------------------------------------------------------------------------------------


def save_training_state(path: str | Path, state: dict) -> Path:
    """Write ``state`` (model, optimizer, scheduler, step, rng, data, ...) atomically to ``path``."""
    missing = [key for key in REQUIRED_KEYS if key not in state]
    if missing:
        raise SpecdraftError(f"training state lacks {', '.join(missing)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # an unwritable run folder or a full disk: name the checkpoint, not its temp file
        raise naming(exc, path) from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)  # a kill -9 skips this: the next start of the run removes it (files.remove_leftovers)
    return path


def load_training_state(path: str | Path) -> dict:
    """A state written by :func:`save_training_state`; a missing, truncated or foreign file is a SpecdraftError."""
    path = Path(path)
    if not path.is_file():
        raise SpecdraftError(f"no training checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a damaged file
        raise SpecdraftError(f"corrupt training checkpoint {path}: {str(exc).splitlines()[0][:200]}") from None
    if not isinstance(state, dict) or any(key not in state for key in REQUIRED_KEYS):
        raise SpecdraftError(f"{path} is not a specdraft training checkpoint (needs {', '.join(REQUIRED_KEYS)})")
    return state


# --- Hugging Face export ---------------------------------------------------------------------------------------------


def export_path(out: str | Path) -> Path:
    """Where a run folder keeps its exported model."""
    return Path(out) / "model"


def is_complete_export(path: str | Path) -> bool:
    """Whether ``path`` is a finished export (every file of :data:`EXPORT_FILES` present)."""
    return all((Path(path) / name).is_file() for name in EXPORT_FILES)


def hardware(device: str = "auto") -> str:
    """One line describing the machine a run trained on (``device``: the run's device setting), for model cards:
    the GPU's name when it ran on CUDA, else the CPU's."""
    where = resolve_device(device).device
    name = f"{torch.cuda.get_device_name(where)}" if where.type == "cuda" else f"CPU ({cpu_model()})"
    return (f"{name}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"{torch.get_num_threads()} torch threads, torch {torch.__version__}")


def export_hf(model, out: str | Path, target: str, card: dict, dtype: torch.dtype = torch.float32,
              share_embeddings: bool = False, ranking: torch.Tensor | None = None,
              options: dict[str, object] | None = None) -> Path:
    """Save a transformers ``LlamaForCausalLM`` drafter as a self-contained checkpoint folder at ``out``.

    Args:
        model: the trained drafter (left unchanged: a copy is cast to ``dtype``).
        out: destination folder; replaced as a whole if it exists.
        target: the target's name or path, whose tokenizer files are copied.
        card: the model card's facts: ``title``, ``command``, ``data``, ``budget`` (dict), ``metrics`` (dict).
        dtype: weight dtype of the saved safetensors (float32 or bfloat16).
        share_embeddings: leave the token embeddings out (they must be the target's): the folder gets
            ``shared_embeddings.json`` and loads as a drafter of ``target`` (:mod:`specdraft.models.shared_embeddings`).
        ranking: (V,) token ids by frequency in the training responses, stored for ``draft_vocab``
            (:mod:`specdraft.draft_vocab`).
        options: default drafter options the folder ships (``drafter_options.json``; e.g. the ``draft_vocab`` it
            was trained for), overridden by options given at load time.
    """
    from transformers import GenerationConfig

    def fill(tmp: Path) -> None:
        copy = type(model)(model.config)
        copy.load_state_dict(model.state_dict())
        copy.to(dtype).save_pretrained(tmp)
        if share_embeddings:
            from specdraft.models.shared_embeddings import drop_embeddings, write_shared_embeddings

            drop_embeddings(tmp / "model.safetensors")
            write_shared_embeddings(tmp, target, model.get_input_embeddings().weight)
        load_tokenizer(target).save_pretrained(tmp)
        config = model.config
        GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                         pad_token_id=config.pad_token_id).save_pretrained(tmp)
        (tmp / "README.md").write_text(model_card(card | {"target": target, "dtype": str(dtype)}))
        if ranking is not None:
            from specdraft.draft_vocab import save_token_ranking

            save_token_ranking(tmp, ranking)
        if options:
            from specdraft.drafters.options import DRAFTER_OPTIONS_FILE

            (tmp / DRAFTER_OPTIONS_FILE).write_text(json.dumps(options) + "\n")

    return build_folder(Path(out), fill)


def model_card(card: dict) -> str:
    """A README.md: what the drafter is for, how it was made (exact command, data, budget) and its metrics."""
    lines = [
        f"# {card.get('title', 'specdraft drafter')}",
        "",
        f"A draft model for speculative decoding with target `{card['target']}` (same tokenizer), trained with",
        "specdraft's draft training pipeline (Goel et al. 2024, *Direct Alignment of Draft Model for Speculative",
        "Decoding with Chat-Fine-Tuned LLMs*, arXiv 2403.00858).",
        "",
        "## How it was made",
        "",
        f"- Command: `{card.get('command', '(library call)')}`",
        f"- Data: {card.get('data', 'unknown')}",
        f"- Weights dtype: {card['dtype']}",
    ]
    lines += [f"- {key}: {value}" for key, value in card.get("budget", {}).items()]
    lines += ["", "## Metrics", "", "| metric | value |", "|---|---|"]
    lines += [f"| {key} | {_fmt(value)} |" for key, value in card.get("metrics", {}).items()]
    lines += ["", "## Config", "", "```json", json.dumps(card.get("config", {}), indent=1, default=str), "```", ""]
    return "\n".join(lines)


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
