"""Loading what drafters draft with, checked against the target: draft models (vocabulary, special tokens,
tokenizer; the ``quantize`` and ``draft_vocab`` options of their folder or of the caller) and heads folders (their
shipped ``drafter_options.json``). Drafters by name build themselves from these (``from_options``); the names are
:mod:`specdraft.drafters.registry`'s, and :func:`~specdraft.drafters.registry.load_drafter` is the one entry."""

from __future__ import annotations

from pathlib import Path

import torch

from specdraft.compat import check_compatible
from specdraft.draft_vocab import draft_subset
from specdraft.drafters.options import build, folder_options
from specdraft.errors import SpecdraftError
from specdraft.models import CausalLM, load_model, load_tokenizer, quantized
from specdraft.models.native_llama import NativeLlama
from specdraft.models.quantized_llama import SCHEMES, QuantizedLlama
from specdraft.models.registry import DEFAULT_DRAFTERS, resolve, resolve_heads
from specdraft.models.shared_embeddings import embeddings_for, shared_embeddings


def draft_model_path(draft: str):
    """The folder (or hub id) a draft model name resolves to."""
    return resolve(draft)


def draft_model_parts(target: CausalLM, target_tokenizer, draft: str, dtype: torch.dtype, backend: str,
                      options: dict[str, str], given: dict[str, str] | None = None,
                      ) -> tuple[CausalLM, torch.Tensor | None, dict[str, str]]:
    """The draft model ``draft`` (checked against the target) with the ``quantize`` and ``draft_vocab`` of
    ``options`` applied: (model, the draft vocabulary's token ids or None, the other options). ``quantize=none``
    keeps the dense drafter (over a folder's default); a ``quantize`` not in ``given`` (a folder's default) is
    dropped where the int8 kernels cannot run: off an x86 CPU with them, or for a target on another device."""
    options = dict(options)
    quantize = options.pop("quantize", None)
    if quantize == "none":
        quantize = None
    on_cpu = str(getattr(target, "device", None) or "cpu") == "cpu"
    if quantize and "quantize" not in (given or {}) and not (_can_quantize() and on_cpu):
        quantize = None  # the folder's default where the int8 kernels cannot run: the dense drafter
    model = load_draft_model(target, target_tokenizer, draft, dtype, backend, quantize)
    keep = None
    if "draft_vocab" in options:  # FR-Spec: the ranking stored next to the drafter's weights
        keep = draft_subset(str(draft_model_path(draft)), model.vocab_size, options.pop("draft_vocab"))
    return model, keep, options


def default_draft_model(target: CausalLM, options: dict[str, str], method: str) -> tuple[str, dict[str, str]]:
    """The draft model a drafter built on one names (``draft=NAME`` in ``options``, else the target's shipped
    drafter) and the options to load it with: ``options`` (less ``draft``) over the folder's ``quantize`` and
    ``draft_vocab`` defaults (its other defaults are for its own chain drafts)."""
    options = dict(options)
    draft = options.pop("draft", None) or DEFAULT_DRAFTERS.get(getattr(target, "name", ""))
    if not draft:
        raise SpecdraftError(f"{method} needs a draft model: --drafter-option draft=NAME_OR_PATH (the target "
                             f"{getattr(target, 'name', '?')!r} ships none)")
    defaults = folder_options(draft_model_path(draft))
    return draft, {k: defaults[k] for k in ("quantize", "draft_vocab") if k in defaults} | options


def _can_quantize() -> bool:
    return quantized.available()


def quantize_draft(model: CausalLM, scheme: str) -> CausalLM:
    """A native Llama draft model on block-quantized weights (``int8``: Q8_0, ``int4``: Q4_1 layers)."""
    if scheme not in SCHEMES:
        raise SpecdraftError(f"drafter option quantize must be one of none, {', '.join(SCHEMES)}, got {scheme!r}")
    if not isinstance(model, NativeLlama) or isinstance(model, QuantizedLlama):
        raise SpecdraftError(f"quantize={scheme} needs a dense Llama-family draft model; {model.name} is not one")
    if not _can_quantize():
        raise SpecdraftError(f"quantize={scheme} needs specdraft's int8 kernels, which cannot run here (an x86 CPU "
                             "with AVX2, FMA and F16C and a C++ compiler)")
    quantized = QuantizedLlama.from_dense(model, scheme)
    quantized.name = model.name
    return quantized


def load_draft_model(
    target: CausalLM, target_tokenizer, draft: str, dtype: torch.dtype = torch.float32, backend: str = "auto",
    quantize: str | None = None,
) -> CausalLM:
    """A draft model, checked against the target (vocabulary, special tokens, tokenizer fingerprint), on the
    target's device; one that shares the target's token embeddings gets them from ``target``. ``quantize`` (``int8``,
    ``int4``) rounds a native Llama draft model's weights to blocks at load
    (:class:`~specdraft.models.quantized_llama.QuantizedLlama`).
    """
    folder = resolve(draft)
    shared = isinstance(folder, Path) and shared_embeddings(folder) is not None
    device = getattr(target, "device", None) or "cpu"  # an HFCausalLM on CUDA: its drafter decodes there too
    model = load_model(draft, torch.float32 if quantize else dtype, backend,
                       embeddings_for(folder, target, draft) if shared else None, device=device)
    if quantize:
        model = quantize_draft(model, quantize)
    try:
        draft_tokenizer = load_tokenizer(draft)
    except SpecdraftError:
        draft_tokenizer = None  # a bare checkpoint: only the vocabulary size can be checked
    check_compatible(target, target_tokenizer, model, draft_tokenizer)
    return model


def on_draft_model(factory, method: str, target: CausalLM, tokenizer, options: dict[str, str]):
    """``factory(model=..., name=..., keep=..., **options)`` on the draft model ``options`` names (``draft=NAME``,
    default: the target's shipped drafter), loaded in the target's dtype with its folder's ``quantize`` and
    ``draft_vocab`` (drafters built on a draft model by name: GSD, BiLD)."""
    draft, merged = default_draft_model(target, options, method)
    dtype = getattr(target, "dtype", torch.float32)
    model, keep, rest = draft_model_parts(target, tokenizer, draft, dtype, "auto", merged, options)
    return build(factory, rest, model=model, name=f"{method}:{draft}", keep=keep)


def with_heads_defaults(options: dict[str, str], method: str, kind: str | None = None) -> dict[str, str]:
    """``options`` over the defaults shipped in the heads folder ``heads=PATH`` names (``drafter_options.json``);
    without ``heads``, a clear error naming how to train them (``specdraft train-heads --kind KIND``)."""
    if "heads" not in options:
        how = "specdraft train-heads" + (f" --kind {kind}" if kind else "")
        raise SpecdraftError(f"{method} needs --drafter-option heads=PATH (a folder made by `{how}`)")
    return folder_options(resolve_heads(options["heads"])) | options
