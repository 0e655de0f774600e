"""The drafter's architecture, derived from the target (Goel et al. 2024, arXiv 2403.00858: a small, shallow
Llama that shares the target's tokenizer, trained from scratch and then aligned by distillation).

The drafter keeps everything that speculative decoding compares token for token: the vocabulary size, the
bos/eos/pad ids and the rotary settings. It ties its input and output embeddings (the 49k-wide LM head dominates
a small draft's cost and parameters) and is shallow: per-layer overhead, not width, dominates draft latency on CPU.

Optional initialisation from the target (:func:`init_embeddings_from_target`): the target's token embedding
table E (V, D) is copied when the widths match; otherwise it is projected onto its top-d right singular vectors,
E V_d (V, d), the rank-d linear map that keeps most of E's energy (PCA without centring), then rescaled so that
its entries have the target's RMS.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import LlamaConfig

from specdraft.errors import SpecdraftError

# name -> (num_layers, hidden_size, num_heads, num_kv_heads, intermediate_size); head_dim 32 everywhere.
PRESETS: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (2, 128, 4, 2, 384),
    "small": (2, 192, 6, 2, 512),
    "base": (4, 256, 8, 4, 768),
}
MAX_POSITIONS = 2048


@dataclass(frozen=True)
class DrafterConfig:
    """A size preset plus explicit overrides; :meth:`llama_config` turns it into a transformers ``LlamaConfig``."""

    preset: str = field(default="tiny", metadata={"help": f"size preset: {', '.join(PRESETS)}"})
    num_layers: int | None = field(default=None, metadata={"help": "override the preset's layer count"})
    hidden_size: int | None = field(default=None, metadata={"help": "override the preset's width d"})
    num_heads: int | None = field(default=None, metadata={"help": "override the preset's attention heads"})
    num_kv_heads: int | None = field(default=None, metadata={"help": "override the preset's key/value heads"})
    intermediate_size: int | None = field(default=None, metadata={"help": "override the preset's FFN width"})
    max_positions: int = field(default=MAX_POSITIONS, metadata={"help": "context cap (min with the target's)"})

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise SpecdraftError(f"preset must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size", "max_positions"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise SpecdraftError(f"{name} must be an integer >= 1, got {value!r}")
        _, hidden, heads, kv_heads, _ = self.sizes()
        if hidden % heads:
            raise SpecdraftError(f"hidden_size {hidden} is not a multiple of num_heads {heads}")
        if (hidden // heads) % 2:
            raise SpecdraftError(f"head dim hidden_size / num_heads = {hidden // heads} must be even (rotary)")
        if heads % kv_heads:
            raise SpecdraftError(f"num_heads {heads} is not a multiple of num_kv_heads {kv_heads}")

    def sizes(self) -> tuple[int, int, int, int, int]:
        """(num_layers, hidden_size, num_heads, num_kv_heads, intermediate_size) after the overrides."""
        preset = PRESETS[self.preset]
        names = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size")
        pairs = zip(names, preset, strict=True)
        return tuple(getattr(self, n) if getattr(self, n) is not None else p for n, p in pairs)

    def llama_config(self, target_config) -> LlamaConfig:
        """The drafter's ``LlamaConfig``: this config's sizes, the target's vocabulary, special ids and rotary."""
        layers, hidden, heads, kv_heads, ffn = self.sizes()
        rope = dict(getattr(target_config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 1e4})
        return LlamaConfig(
            vocab_size=target_config.vocab_size, hidden_size=hidden, intermediate_size=ffn,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=hidden // heads, hidden_act="silu", tie_word_embeddings=True,
            max_position_embeddings=min(self.max_positions, target_config.max_position_embeddings),
            rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-5), rope_parameters=rope,
            bos_token_id=target_config.bos_token_id, eos_token_id=target_config.eos_token_id,
            pad_token_id=getattr(target_config, "pad_token_id", None), initializer_range=0.02,
        )


def project_embeddings(target_embedding: torch.Tensor, width: int) -> torch.Tensor:
    """The target's embedding table at the drafter's width.

    Args:
        target_embedding: (V, D) the target's token embeddings.
        width: d, the drafter's hidden size.
    Returns:
        (V, d) float32: a copy when d == D; else E V_d (top-d right singular vectors; when d > D the extra columns
        are zero), rescaled to the RMS of E.
    """
    table = target_embedding.detach().float()  # (V, D)
    if table.shape[1] == width:
        return table.clone()
    _, _, vh = torch.linalg.svd(table, full_matrices=False)  # vh: (min(V, D), D)
    basis = vh[: min(width, vh.shape[0])].T  # (D, k)
    projected = table @ basis  # (V, k)
    if projected.shape[1] < width:
        projected = torch.cat([projected, projected.new_zeros(table.shape[0], width - projected.shape[1])], dim=1)
    rms_target, rms_projected = table.pow(2).mean().sqrt(), projected.pow(2).mean().sqrt().clamp_min(1e-12)
    return projected * (rms_target / rms_projected)  # (V, d)


@torch.no_grad()
def init_embeddings_from_target(drafter, target_embedding: torch.Tensor) -> None:
    """Overwrite a drafter's (tied) token embeddings with :func:`project_embeddings` of the target's table."""
    weight = drafter.get_input_embeddings().weight  # (V, d)
    if target_embedding.shape[0] != weight.shape[0]:
        raise SpecdraftError(f"vocabulary mismatch: target embeddings have {target_embedding.shape[0]} rows, "
                             f"the drafter {weight.shape[0]}")
    weight.copy_(project_embeddings(target_embedding, weight.shape[1]).to(weight.dtype))


# --- a drafter made of the target's own layers -----------------------------------------------------------------------


@dataclass(frozen=True)
class InitDrafterConfig:
    """Settings of ``specdraft init-drafter``."""

    target: str = field(metadata={"help": "target model (built-in name, folder or cached hub id)"})
    out: str = field(metadata={"help": "output checkpoint folder"})
    layers: str = field(default="0,1", metadata={"help": "the target's decoder layers kept, comma-separated (with "
                                                         "--grow: the target's layers appended to the drafter)"})
    export_dtype: str = field(default="float32", metadata={"help": "exported weights: float32 or bfloat16"})
    grow: str = field(default="", metadata={"help": "a trained drafter of this target to deepen instead: --layers are "
                                                    "appended to it as blocks that start as the identity"})

    def __post_init__(self) -> None:
        self.layer_indices()
        if self.export_dtype not in ("float32", "bfloat16"):
            raise SpecdraftError(f"export_dtype must be float32 or bfloat16, got {self.export_dtype!r}")

    def layer_indices(self) -> list[int]:
        """The kept layers, checked to be distinct, increasing integers >= 0."""
        try:
            layers = [int(v) for v in self.layers.split(",") if v.strip()]
        except ValueError:
            layers = []
        if not layers or min(layers) < 0 or layers != sorted(set(layers)):
            raise SpecdraftError(f"layers must be increasing layer indices >= 0, e.g. 0,1; got {self.layers!r}")
        return layers


def _check_in_range(layers: list[int], total: int) -> None:
    if not layers or max(layers) >= total:
        raise SpecdraftError(f"layers {layers} out of range: the target has {total} decoder layers (0..{total - 1})")


def drafter_from_target_layers(target_model, layers: list[int]):
    """A shallow drafter built from the target itself: its token embeddings, the decoder layers ``layers`` (in
    order), its final norm and its LM head, all copied.

    The early-exit view of self-speculative decoding (Draft & Verify, Zhang et al. 2023, arXiv 2309.08168;
    LayerSkip, Elhoushi et al. 2024, arXiv 2404.16710) drafts with a subset of the target's layers. Here that
    subset becomes a separate model, fine-tuned by distillation (Goel et al. 2024, stage 2) with its own KV cache:
    the copy starts from the target's 2T-token embeddings instead of a drafter pretrained from scratch on a few
    million tokens. The copy has the target's width, so its embeddings can be shared with the target at load time
    (``finetune --freeze-embeddings --share-embeddings``).

    Args:
        target_model: a transformers decoder (``model.embed_tokens``, ``model.layers``, ``model.norm``).
        layers: increasing indices of the decoder layers kept.
    Returns:
        a model of the target's class with ``len(layers)`` layers, in float32.
    """
    import copy

    base = getattr(target_model, "model", None)
    if base is None or not all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm")):
        raise SpecdraftError(f"init-drafter needs a Llama-family decoder (model.embed_tokens, model.layers, "
                             f"model.norm); {type(target_model).__name__} has another layout")
    total = len(base.layers)
    _check_in_range(layers, total)
    config = copy.deepcopy(target_model.config)
    config.num_hidden_layers = len(layers)
    if isinstance(getattr(config, "layer_types", None), list):  # per-layer attention kinds follow the kept layers
        config.layer_types = [config.layer_types[i] for i in layers]
    drafter = type(target_model)(config).float()
    with torch.no_grad():
        drafter.model.embed_tokens.load_state_dict(base.embed_tokens.state_dict())
        for new, old in enumerate(layers):
            drafter.model.layers[new].load_state_dict(base.layers[old].state_dict())
        drafter.model.norm.load_state_dict(base.norm.state_dict())
        if not config.tie_word_embeddings:
            drafter.lm_head.load_state_dict(target_model.lm_head.state_dict())
    drafter.tie_weights()
    return drafter.float().eval()


def grow_drafter(drafter, target_model, layers: list[int]):
    """Deepen a trained drafter without changing what it computes: LLaMA Pro's block expansion (Wu et al. 2024,
    arXiv 2401.02415, eq. 2-3). Copies of the target's decoder layers ``layers`` are appended after the drafter's
    own, each with its attention output projection and its MLP down projection set to zero, so each new block adds
    zero to the residual stream and the grown drafter's logits equal the drafter's. Fine-tuning then trains the new
    blocks from the target's weights (the zero projections get gradients at once; the rest once they are non-zero)
    while the drafter starts at the acceptance it already had.

    Args:
        drafter: a transformers Llama-family drafter of the target's width (e.g. from :func:`init_drafter`).
        target_model: the transformers target whose layers are copied.
        layers: the target's decoder layer indices, appended in this order.
    Returns:
        a new float32 model of the drafter's class with ``num_hidden_layers + len(layers)`` layers.
    """
    import copy

    base, source = getattr(drafter, "model", None), getattr(target_model, "model", None)
    if base is None or source is None or not all(hasattr(m, "layers") for m in (base, source)):
        raise SpecdraftError("--grow needs Llama-family models (model.layers) for the drafter and the target")
    if drafter.config.hidden_size != target_model.config.hidden_size:
        raise SpecdraftError(f"--grow needs a drafter of the target's width: {drafter.config.hidden_size} against "
                             f"{target_model.config.hidden_size}")
    _check_in_range(layers, len(source.layers))
    config = copy.deepcopy(drafter.config)
    config.num_hidden_layers = len(base.layers) + len(layers)
    if isinstance(getattr(config, "layer_types", None), list):
        kinds = getattr(target_model.config, "layer_types", None) or ["full_attention"] * len(source.layers)
        config.layer_types = list(config.layer_types) + [kinds[i] for i in layers]
    grown = type(drafter)(config).float()
    with torch.no_grad():
        missing, _ = grown.load_state_dict(drafter.state_dict(), strict=False)
        for new, old in enumerate(layers, start=len(base.layers)):
            block = grown.model.layers[new]
            block.load_state_dict(source.layers[old].state_dict())
            block.self_attn.o_proj.weight.zero_()  # (D, H*hd): the block's attention adds nothing yet
            block.mlp.down_proj.weight.zero_()  # (D, F): nor does its MLP
            for proj in (block.self_attn.o_proj, block.mlp.down_proj):
                if getattr(proj, "bias", None) is not None:
                    proj.bias.zero_()
    unexpected = [k for k in missing if not k.startswith(tuple(f"model.layers.{i}." for i in
                                                               range(len(base.layers), config.num_hidden_layers)))]
    if unexpected:
        raise SpecdraftError(f"--grow: the drafter lacks weights the grown model needs: {unexpected[:3]}")
    grown.tie_weights()
    return grown.float().eval()


def init_drafter(config: InitDrafterConfig, command: str | None = None):
    """Write :func:`drafter_from_target_layers` of ``config.target`` (or, with ``grow``, :func:`grow_drafter` of that
    drafter) as a checkpoint folder; returns its path."""
    from specdraft.models.registry import load_model
    from specdraft.training.runs.checkpoint import export_hf

    target_model = load_model(config.target, torch.float32, backend="hf").model
    layers = config.layer_indices()
    if config.grow:
        drafter = grow_drafter(load_trained_drafter(config.grow, target_model), target_model, layers)
        title = f"specdraft drafter ({config.grow} and the target's layers {config.layers}, not yet fine-tuned)"
        data = f"none: {config.grow}'s weights and identity-initialised copies of the target's layers"
    else:
        drafter = drafter_from_target_layers(target_model, layers)
        title, data = f"specdraft drafter (layers {config.layers} of the target, not yet fine-tuned)", \
            "none: weights copied from the target"
    params = sum(p.numel() for p in drafter.parameters())
    card = {"title": title, "command": command or "", "data": data,
            "budget": {"Parameters": f"{params:,} (embeddings included)"}, "metrics": {}}
    dtype = torch.bfloat16 if config.export_dtype == "bfloat16" else torch.float32
    return export_hf(drafter, config.out, config.target, card, dtype)


def load_trained_drafter(name: str, target):
    """A drafter checkpoint as a transformers model in float32; a drafter that ships no embedding table
    (``shared_embeddings.json``) gets ``target``'s (a loaded target: a :class:`~specdraft.models.base.CausalLM` or a
    transformers model), checked to be the table it was trained with."""
    from transformers import AutoModelForCausalLM

    from specdraft.models.registry import CHECKPOINT_ERRORS, resolve
    from specdraft.models.shared_embeddings import embeddings_for, shared_embeddings

    where = resolve(name)
    try:
        drafter = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32)
    except CHECKPOINT_ERRORS as exc:
        raise SpecdraftError(f"cannot load drafter {name!r}: {str(exc).splitlines()[0]}") from None
    if shared_embeddings(where) is not None:
        with torch.no_grad():
            drafter.get_input_embeddings().weight.copy_(embeddings_for(where, target, name))
        drafter.tie_weights()
    return drafter
