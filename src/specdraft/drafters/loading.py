"""Build a drafter by name: a draft model folder or name (checked against the target), or a drafter from
:data:`specdraft.drafters.NAMED_DRAFTERS`."""

from __future__ import annotations

from pathlib import Path

import torch

from specdraft.compat import check_compatible
from specdraft.drafters import NAMED_DRAFTERS, Drafter, draft_model_drafter
from specdraft.drafters.options import build, folder_options
from specdraft.errors import SpecdraftError
from specdraft.models import CausalLM, load_model, load_tokenizer


def load_drafter(
    target: CausalLM,
    target_tokenizer,
    draft: str | None = None,
    drafter: str | None = None,
    dtype: torch.dtype = torch.float32,
    backend: str = "auto",
    options: dict[str, str] | None = None,
) -> Drafter | None:
    """A drafter from a draft model name/path (checked for compatibility; its options are
    :func:`~specdraft.drafters.combined.draft_model_drafter`'s: ``tree_branching``, ``tree_nodes`` turn on its tree
    mode, ``prompt_lookup`` and the others combine it with copies) or a named drafter, with ``options``
    (``{KEY: VALUE}`` strings). A draft model folder may hold ``drafter_options.json``, the options it was measured
    best with (e.g. the shipped drafter's ``draft_vocab`` and ``confidence_threshold``); given options override
    them. ``quantize=int8`` or ``int4`` runs a native Llama draft model on block-quantized weights (its draft
    vocabulary's head rows too): drafting gets cheaper, acceptance may move, the target's output never changes."""
    if draft and drafter:
        raise SpecdraftError("give either a draft model (--draft) or a drafter by name (--drafter), not both")
    if drafter:
        if drafter not in NAMED_DRAFTERS:
            raise SpecdraftError(f"unknown drafter {drafter!r}; known: {', '.join(sorted(NAMED_DRAFTERS))}")
        return NAMED_DRAFTERS[drafter](target, target_tokenizer, dict(options or {}))
    if not draft:
        if options:
            raise SpecdraftError("drafter options need a drafter (--draft or --drafter)")
        return None
    from specdraft.models.registry import resolve

    folder = resolve(draft)
    given = dict(options or {})
    options = folder_options(folder) | given
    quantize = options.pop("quantize", None)
    if quantize and "quantize" not in given and not _can_quantize():
        quantize = None  # the folder's default where the int8 kernels cannot run: the dense drafter
    model = load_draft_model(target, target_tokenizer, draft, dtype, backend, quantize)
    keep = None
    if "draft_vocab" in options:  # FR-Spec: the ranking stored next to the drafter's weights
        from specdraft.draft_vocab import draft_subset

        keep = draft_subset(str(folder), model.vocab_size, options.pop("draft_vocab"))
    return build(draft_model_drafter, options, model=model, name=f"draft:{draft}", keep=keep)


def _can_quantize() -> bool:
    from specdraft.models import quantized

    return quantized.available()


def quantize_draft(model: CausalLM, scheme: str) -> CausalLM:
    """A native Llama draft model on block-quantized weights (``int8``: Q8_0, ``int4``: Q4_1 layers)."""
    from specdraft.models.native_llama import NativeLlama
    from specdraft.models.quantized_llama import SCHEMES, QuantizedLlama

    if scheme not in SCHEMES:
        raise SpecdraftError(f"drafter option quantize must be one of {', '.join(SCHEMES)}, got {scheme!r}")
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
    from specdraft.models.registry import resolve
    from specdraft.models.shared_embeddings import embeddings_for, shared_embeddings

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
