"""What every export format shares: its settings, the registry of formats, and the checked drafter.

A format is a function ``(ExportConfig, CheckedDrafter) -> Path`` registered under its name with
:func:`register`; ``specdraft export --format NAME`` looks it up in :data:`FORMATS` and never branches on a name.
Before any format runs, :func:`check_drafter` loads the target and the drafter and refuses a pair that cannot
speculate together (vocabulary, special tokens, tokenizer, and for a drafter that shares its target's embeddings,
the table's fingerprint).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdraft.errors import SpecdraftError

GGUF_TYPES = ("bf16", "q8_0", "q4_0")


@dataclass(frozen=True)
class ExportConfig:
    """Settings of one export (``specdraft export``)."""

    drafter: str = field(metadata={"help": "drafter name or checkpoint folder"})
    format: str = field(metadata={"help": "export format, a key of FORMATS"})
    out: str = field(metadata={"help": "output path (a folder, or a .gguf file for gguf)"})
    target: str | None = field(default=None, metadata={
        "help": "target name or folder; default: the target named by the drafter, else smollm2-135m-instruct"})
    target_gguf: str | None = field(default=None, metadata={
        "help": "gguf: the target's GGUF file, whose tokenizer metadata the export copies (default: the built-in's)"})
    gguf_type: str | None = field(default=None, metadata={
        "help": "gguf, eagle3-gguf, dflash-gguf: weight type of the matrices, bf16, q8_0 or q4_0; "
                "default: the format's"})
    gguf_output_type: str | None = field(default=None, metadata={
        "help": "gguf, eagle3-gguf, dflash-gguf: weight type of the output matrix (a drafter's shared embedding "
                "table; dflash-gguf: also its token_embd); "
                "default: gguf_type when given, else the format's"})
    num_draft_tokens: int = field(default=4, metadata={"help": "speculators: γ, draft tokens per target forward"})
    overwrite: bool = field(default=False, metadata={"help": "replace an existing export (once the new one is done)"})

    def gguf_types(self, defaults: tuple[str, str]) -> tuple[str, str]:
        """(matrices, output matrix) types: as given (the output matrix as the matrices when only those are
        given), else the format's ``defaults``."""
        layers = self.gguf_type or defaults[0]
        return layers, self.gguf_output_type or (self.gguf_type if self.gguf_type else defaults[1])

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise SpecdraftError(f"unknown export format {self.format!r}; known: {', '.join(sorted(FORMATS))}")
        for name in ("gguf_type", "gguf_output_type"):
            value = getattr(self, name)
            if value is not None and value not in GGUF_TYPES:
                raise SpecdraftError(f"{name} must be one of {', '.join(GGUF_TYPES)}, got {value!r}")
        if self.num_draft_tokens < 1:
            raise SpecdraftError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if not self.out or not str(self.out).strip():
            raise SpecdraftError("out is empty")


@dataclass(frozen=True)
class CheckedDrafter:
    """A drafter checked against its target.

    ``folder``: its checkpoint folder; ``table``: (V, D) the target's embedding table when the drafter shares it
    (None when the drafter stores its own); ``tokenizer``: the tokenizer both sides share.
    """

    name: str
    folder: Path
    target_name: str
    config: dict
    tokenizer: object
    table: torch.Tensor | None


ExportFn = Callable[[ExportConfig, CheckedDrafter], Path]
CheckFn = Callable[[ExportConfig], CheckedDrafter]
FORMATS: dict[str, ExportFn] = {}
CHECKS: dict[str, CheckFn] = {}  # formats of other inputs than a draft model (e.g. heads) check them their own way


def register(name: str, check: CheckFn | None = None) -> Callable[[ExportFn], ExportFn]:
    """Register an export format under ``name`` (``specdraft export --format NAME``); ``check`` replaces
    :func:`check_drafter` for a format whose input is not a draft model checkpoint."""

    def decorator(fn: ExportFn) -> ExportFn:
        FORMATS[name] = fn
        if check is not None:
            CHECKS[name] = check
        return fn

    return decorator


def default_target(folder: Path) -> str:
    """The target a drafter folder names (``shared_embeddings.json``), else the built-in SmolLM2."""
    from specdraft.models.registry import SMOLLM2
    from specdraft.models.shared_embeddings import shared_embeddings

    record = shared_embeddings(folder)
    return record["target"] if record is not None else SMOLLM2


def check_drafter(config: ExportConfig) -> CheckedDrafter:
    """Load the target and the drafter and check that they can speculate together (raises SpecdraftError)."""
    from specdraft.api import load_draft_model, load_target
    from specdraft.models.registry import load_tokenizer, resolve
    from specdraft.models.shared_embeddings import shared_embeddings, target_weights

    folder = resolve(config.drafter)
    if not isinstance(folder, Path):
        raise SpecdraftError(f"export needs a local drafter folder, got hub id {config.drafter!r}")
    target_name = config.target or default_target(folder)
    target, tokenizer = load_target(target_name, torch.float32)
    load_draft_model(target, tokenizer, config.drafter)  # vocabulary, special tokens, tokenizer, embeddings checks
    try:
        tokenizer = load_tokenizer(config.drafter)
    except SpecdraftError:
        pass  # a bare checkpoint: it speculates with the target's tokenizer
    table = target_weights(target)[0] if shared_embeddings(folder) is not None else None
    drafter_config = json.loads((folder / "config.json").read_text())
    return CheckedDrafter(config.drafter, folder, target_name, drafter_config, tokenizer, table)


def export(config: ExportConfig) -> Path:
    """Export ``config.drafter`` in ``config.format`` to ``config.out``; refuses an existing ``out`` unless
    ``config.overwrite`` (then the old export is replaced only once the new one is complete)."""
    out = Path(config.out).expanduser()
    if out.exists() and not config.overwrite:
        raise SpecdraftError(f"{out} exists; pass --overwrite to replace it")
    return FORMATS[config.format](config, CHECKS.get(config.format, check_drafter)(config))
