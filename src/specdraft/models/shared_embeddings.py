"""Drafters that share the target's token embeddings instead of storing them.

A drafter initialised from the target's own layers (``specdraft init-drafter``) has the target's width, so its
tied embedding table (V, D) is the target's: for SmolLM2-135M that is 49152 x 576, 57 MB in bf16, more than the
rest of a 2-layer drafter. When fine-tuning keeps that table frozen (``finetune --freeze-embeddings``), the export
can leave it out (``--share-embeddings``) and write ``shared_embeddings.json`` instead; loading such a drafter then
takes the table from the target it drafts for, as EAGLE and Medusa heads take the target's embeddings and LM head.

``shared_embeddings.json`` names the target the drafter was trained with and a fingerprint of its table (the norms
of a few fixed rows), so that pairing the drafter with another target of the same tokenizer but different
embeddings is refused with a clear error instead of drafting from a table it never saw.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdraft.errors import SpecdraftError

SHARED_EMBEDDINGS_FILE = "shared_embeddings.json"
EMBEDDING_KEY = "model.embed_tokens.weight"
FINGERPRINT_RTOL = 2e-2  # bf16 and fp32 copies of one table agree far closer than this; other tables do not


def target_weights(target) -> tuple[torch.Tensor, torch.Tensor]:
    """(embeddings (V, D), LM head (V, D)) of a NativeLlama, an HFCausalLM or a transformers model."""
    if hasattr(target, "embed_weight") and hasattr(target, "lm_head_weight"):
        return target.embed_weight, target.lm_head_weight
    model = target if hasattr(target, "get_output_embeddings") else getattr(target, "model", None)  # HFCausalLM
    if model is None or not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
        raise SpecdraftError(f"cannot find the embeddings and LM head of target {type(target).__name__}")
    return model.get_input_embeddings().weight, model.get_output_embeddings().weight


def fingerprint(table: torch.Tensor) -> list[float]:
    """Norms of 8 fixed rows of an embedding table (V, D), spread over the vocabulary."""
    rows = torch.linspace(0, table.shape[0] - 1, 8).long()  # (8,)
    return [round(float(v), 5) for v in table.detach()[rows].float().norm(dim=-1)]


def shared_embeddings(folder: str | Path) -> dict | None:
    """The ``shared_embeddings.json`` record of a checkpoint folder, or None when it stores its own table."""
    path = Path(folder) / SHARED_EMBEDDINGS_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        shape, prints = record["shape"], record["fingerprint"]
        if not (isinstance(shape, list) and len(shape) == 2 and isinstance(prints, list) and len(prints) == 8):
            raise ValueError("bad shape or fingerprint")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SpecdraftError(f"corrupt {path}: {exc}") from None
    return record


def write_shared_embeddings(folder: str | Path, target: str, table: torch.Tensor) -> None:
    """Record that the checkpoint in ``folder`` takes its (V, D) embedding table from ``target``."""
    record = {"target": target, "shape": list(table.shape), "fingerprint": fingerprint(table)}
    (Path(folder) / SHARED_EMBEDDINGS_FILE).write_text(json.dumps(record, indent=1) + "\n")


def embeddings_for(folder: str | Path, target, name: str) -> torch.Tensor:
    """The target's embedding table (V, D) for the shared-embeddings drafter in ``folder``, after checking that it
    is the table the drafter was trained with (shape and fingerprint)."""
    record = shared_embeddings(folder)
    if record is None:
        raise SpecdraftError(f"{name} stores its own embeddings ({SHARED_EMBEDDINGS_FILE} is absent)")
    table, _ = target_weights(target)  # (V, D)
    if list(table.shape) != record["shape"]:
        raise SpecdraftError(f"drafter {name} shares the embeddings of {record['target']!r}, shape {record['shape']}; "
                             f"target {getattr(target, 'name', '')!r} has {list(table.shape)}")
    if not torch.allclose(torch.tensor(fingerprint(table)), torch.tensor(record["fingerprint"]),
                          rtol=FINGERPRINT_RTOL):
        raise SpecdraftError(f"drafter {name} was trained with the embeddings of {record['target']!r}; target "
                             f"{getattr(target, 'name', '')!r} has other embeddings (fingerprint mismatch)")
    return table


def drop_embeddings(safetensors_file: str | Path) -> None:
    """Rewrite a saved ``model.safetensors`` without its embedding table (in place, atomically)."""
    from safetensors.torch import load_file, save_file

    path = Path(safetensors_file)
    tensors = load_file(path)
    if tensors.pop(EMBEDDING_KEY, None) is None:
        raise SpecdraftError(f"{path} holds no {EMBEDDING_KEY}")
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    tmp.replace(path)
