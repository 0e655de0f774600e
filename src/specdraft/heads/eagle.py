"""The EAGLE draft head (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty",
arXiv 2401.15077): autoregression at the feature level, one decoder layer on top of the frozen target.

Pair t of the feature stream is ``(f_t, x_{t+1})``: the target's feature of token t and the token that follows it
(the "shifted" token, which removes the uncertainty of which token the feature led to). The head computes

    g_t = DecoderLayer(fc(concat(f_t, E[x_{t+1}])))      # (D,), its prediction of f_{t+1}
    logits of x_{t+2} = W_lm g_t

with E the target's embeddings and W_lm the target's LM head, both frozen and never stored in the head. The
decoder layer is a Llama block (the native model's code: fused q/k/v and gate/up, rotary positions, a static KV
cache and tree masks). As in EAGLE-1 implementations (vLLM's ``llama_eagle`` port replaces the first draft layer's
input norm with the identity), the block's input RMSNorm is dropped (fc feeds attention directly); its MLP norm is
kept.

Features: EAGLE regresses the LM head's input. In specdraft the target's features (``return_hidden=True``,
transformers' ``hidden_states[-1]``) are final-normed, i.e. already the LM head's input, so the head's output goes
straight into W_lm; applying the target's final norm again would be inconsistent with the regression target.

Loss (EAGLE's L = L_reg + w_cls L_cls; equation number not checked): smooth L1 between g_t and the true f_{t+1},
plus ``cls_weight`` (EAGLE: 0.1) times the cross-entropy of the head's token distribution against the target's
softmax(W_lm f_{t+1}).
EAGLE's optional feature noise (uniform, added to the input features during training) is ``noise`` here.

Trained as the ``eagle`` kind of ``specdraft train-heads`` (:mod:`specdraft.training.heads.kinds`); the exported
folder (see :mod:`specdraft.heads`) holds only fc and the layer, 2 D^2 + D + (H + 2 K) hd D + H hd D + 3 D F + D
parameters (4.2 M for SmolLM2-135M, whose vocabulary projection alone has 28 M).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.heads.fspad import FeatureSampling, parse_fspad, partial_smooth_l1
from specdraft.models.native_llama import DecoderLayer, LayerStep, StaticKVCache, causal_mask, rope_table

_SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "rms_norm_eps", "max_position_embeddings", "attention_bias", "mlp_bias")


def head_config(target_config) -> dict:
    """The head's sizes, taken from the target's transformers config (the head's block has the target's shape)."""
    values = {key: getattr(target_config, key, None) for key in _SIZE_KEYS}
    if values["head_dim"] is None:
        values["head_dim"] = target_config.hidden_size // target_config.num_attention_heads
    values["num_key_value_heads"] = values["num_key_value_heads"] or values["num_attention_heads"]
    values["rms_norm_eps"] = values["rms_norm_eps"] or 1e-6
    values["attention_bias"], values["mlp_bias"] = bool(values["attention_bias"]), bool(values["mlp_bias"])
    rope = dict(getattr(target_config, "rope_parameters", None) or {})
    values["rope_theta"] = float(rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0)))
    missing = [key for key, value in values.items() if value is None]
    if missing:
        raise SpecdraftError(f"target config lacks {', '.join(missing)}: cannot size an EAGLE head")
    return values


def llama_config(sizes: dict):
    from transformers import LlamaConfig

    extra = {k: v for k, v in sizes.items() if k != "rope_theta"}
    config = LlamaConfig(**extra, num_hidden_layers=1, hidden_act="silu",
                         rope_parameters={"rope_type": "default", "rope_theta": sizes["rope_theta"]})
    config.head_dim = sizes["head_dim"]
    return config


class _EagleLayer(DecoderLayer):
    """The native Llama block without its input norm (EAGLE's first draft layer), with trainable weights."""

    def __init__(self, config) -> None:
        super().__init__(config, torch.float32)
        del self.attn_norm
        for name, parameter in self.named_parameters():
            parameter.requires_grad_(True)
            with torch.no_grad():
                parameter.fill_(1.0) if name == "mlp_norm" else parameter.normal_(0.0, 0.02)
                if name.endswith("bias"):
                    parameter.zero_()

    def forward(self, hidden: torch.Tensor, cache: StaticKVCache, index: int, step: LayerStep) -> torch.Tensor:
        """(B, T, D) -> (B, T, D); writes keys and values of the new positions into ``cache``."""
        hidden = hidden + self._attention(hidden, cache, index, step)
        normed = F.rms_norm(hidden, self.mlp_norm.shape, self.mlp_norm.to(hidden.dtype), self.eps)  # (B, T, D)
        return hidden + self._mlp(normed)


class EagleHead(nn.Module):
    """fc (2D -> D) and one decoder layer; predicts the next feature from (feature, next token embedding) pairs.
    ``sampling`` = M > 0 adds FSPAD's feature sampling in front (:class:`specdraft.heads.fspad.FeatureSampling`)."""

    def __init__(self, sizes: dict, sampling: int = 0) -> None:
        super().__init__()
        self.sizes = dict(sizes)
        self.config = llama_config(sizes)
        hidden = sizes["hidden_size"]
        self.sampling = FeatureSampling(hidden, sampling) if sampling else None
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        nn.init.normal_(self.fc.weight, 0.0, 0.02)
        nn.init.zeros_(self.fc.bias)
        self.layer = _EagleLayer(self.config)
        cos, sin = rope_table(self.config, torch.float32)
        self.register_buffer("rope_cos", cos, persistent=False)  # (P, hd/2)
        self.register_buffer("rope_sin", sin, persistent=False)  # (P, hd/2)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def new_cache(self, capacity: int, batch_size: int = 1, dtype: torch.dtype | None = None) -> StaticKVCache:
        """An empty cache of ``capacity`` pairs (slots; positions are given separately in tree steps)."""
        config = self.config
        return StaticKVCache(1, batch_size, config.num_key_value_heads, capacity, config.head_dim,
                             dtype or self.dtype, self.fc.weight.device)

    def forward(self, features: torch.Tensor, next_embeds: torch.Tensor, cache: StaticKVCache | None = None,
                positions: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted next features for the pairs (features, next_embeds), appended to ``cache``.

        Args:
            features: (B, T, D) target features f_t (or the head's own predictions inside a draft tree).
            next_embeds: (B, T, D) target embeddings of x_{t+1}.
            cache: the pairs before these (None: a fresh one, as in training on whole sequences).
            positions: (T,) rotary positions (default: the slots); attention_mask: (T, S) bool over every slot
               (default: causal). Give both for a tree step.

        Returns:
            (B, T, D) predicted features g_t (≈ f_{t+1}).
        """
        batch, steps = features.shape[:2]
        if cache is None:
            device = features.device.type
            autocast = torch.is_autocast_enabled(device)
            cache = self.new_cache(steps, batch, torch.get_autocast_dtype(device) if autocast else self.dtype)
        cache.ensure_room(steps)
        step = self._step(cache.length, steps, positions, attention_mask)
        if self.sampling is not None:
            features = self.sampling(features.to(self.dtype), next_embeds)  # (B, T, D): FSPAD's sampled features
        hidden = self.fc(torch.cat([features, next_embeds], dim=-1).to(self.dtype))  # (B, T, D)
        hidden = self.layer(hidden, cache, 0, step)  # (B, T, D)
        cache.advance(steps)
        return hidden

    def _step(self, start: int, steps: int, positions: torch.Tensor | None, mask: torch.Tensor | None) -> LayerStep:
        return step_layout(self, start, steps, positions, mask, "EAGLE")


def num_parameters(head: EagleHead) -> int:
    """Trainable parameters (the frozen embeddings and LM head are the target's, not the head's)."""
    return sum(p.numel() for p in head.parameters() if p.requires_grad)


def eagle_loss(head: EagleHead, features: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor,
               embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, cls_weight: float = 0.1,
               reg_weight: float = 1.0, noise: float = 0.0, partial_alignment: float = 0.0,
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, int]:
    """EAGLE's training loss, L = reg_weight * L_reg + cls_weight * L_cls (Li et al. 2024: 1.0 and 0.1).

    Pair t = (f_t, x_{t+1}) is trained to predict f_{t+1}: L_reg = SmoothL1(g_t, f_{t+1}) (mean over features),
    L_cls = -sum_v softmax(W_lm f_{t+1})_v log softmax(W_lm g_t)_v; both averaged over the pairs where ``mask``.
    ``partial_alignment`` R in (0, 1) aligns only the first ceil(R*D) features in L_reg (FSPAD's partial alignment
    distillation, :mod:`specdraft.heads.fspad`); 0 or 1 aligns all.

    Args:
        features: (B, T + 1, D) the frozen target's final-normed features of ``tokens`` (no gradient).
        tokens: (B, T + 1) the sequences (right-padded).
        mask: (B, T) bool, which pairs count (e.g. those whose x_{t+1} is a response token).
        noise: half-width of uniform noise added to the input features (EAGLE's data augmentation; 0 = off).

    Returns:
        (scalar loss, number of counted pairs).
    """
    if features.shape[:2] != tokens.shape or mask.shape != (tokens.shape[0], tokens.shape[1] - 1):
        raise SpecdraftError("eagle_loss needs features (B, T+1, D), tokens (B, T+1) and mask (B, T)")
    inputs, targets = features[:, :-1].detach(), features[:, 1:].detach()  # (B, T, D) each
    if noise > 0:
        where = inputs.device if generator is None else generator.device  # drawn where the generator lives
        uniform = torch.rand(inputs.shape, generator=generator, device=where).to(inputs.device)  # (B, T, D)
        inputs = inputs + (uniform * 2 - 1) * noise
    embeds = F.embedding(tokens[:, 1:], embed_weight.detach())  # (B, T, D)
    predicted = head(inputs, embeds)[mask].float()  # (n, D)
    truth = targets[mask].float()  # (n, D)
    count = int(truth.shape[0])
    if count == 0:
        return predicted.sum() * 0.0, 0
    regression = partial_smooth_l1(predicted, truth, partial_alignment)
    lm_head = lm_head_weight.detach().float()
    with torch.no_grad():
        p = torch.softmax(F.linear(truth, lm_head), dim=-1)  # (n, V)
    log_q = torch.log_softmax(F.linear(predicted, lm_head), dim=-1)  # (n, V)
    classification = -(p * log_q).sum(-1).mean()
    return reg_weight * regression + cls_weight * classification, count


# --- the spec: sizes and loss settings, as stored in heads.json --------------------------------------------------

LOSS_OPTIONS = {"cls_weight": 0.1, "reg_weight": 1.0, "noise": 0.0, "partial_alignment": 0.0}


def eagle_spec(target_config, config, options: dict[str, str]) -> dict:
    """The head's sizes (from the target), loss settings (``--options 'cls_weight=0.1;reg_weight=1;noise=0'``) and
    FSPAD's options (``fspad_sampling=M``, ``partial_alignment=R``: :mod:`specdraft.heads.fspad`)."""
    known = [*LOSS_OPTIONS, "fspad_sampling"]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise SpecdraftError(f"unknown eagle option {', '.join(unknown)}; eagle takes: {', '.join(known)}")
    settings = parse_fspad(options, "eagle")
    for name, default in LOSS_OPTIONS.items():
        try:
            settings[name] = float(options.get(name, default))
        except ValueError:
            raise SpecdraftError(f"eagle option {name} must be a number, got {options[name]!r}") from None
        if not math.isfinite(settings[name]) or settings[name] < 0:
            raise SpecdraftError(f"eagle option {name} must be a finite number >= 0, got {settings[name]}")
    return head_config(target_config) | settings


def build_eagle(spec: dict) -> EagleHead:
    """A fresh head from a spec (``heads.json``'s ``spec``); the loss settings ride along as attributes."""
    try:
        head = EagleHead({key: spec[key] for key in (*_SIZE_KEYS, "rope_theta")}, int(spec.get("fspad_sampling", 0)))
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecdraftError(f"bad EAGLE head spec {spec!r}: {exc}") from None
    head.loss_settings = {name: float(spec.get(name, default)) for name, default in LOSS_OPTIONS.items()}
    return head


def step_layout(head, start: int, steps: int, positions: torch.Tensor | None, mask: torch.Tensor | None,
                kind: str) -> LayerStep:
    """Rotary tables and attention mask of one head forward over ``steps`` new tokens after ``start`` cached ones:
    causal, or the given tree ``mask`` (T, start + T). ``head`` carries ``config``, ``rope_cos``/``rope_sin`` and
    ``dtype`` (the EAGLE and EAGLE-3 heads)."""
    groups = head.config.num_attention_heads // head.config.num_key_value_heads
    device = head.rope_cos.device
    if positions is None:
        positions = start + torch.arange(steps, device=device)  # (T,)
    if int(positions.max()) >= head.rope_cos.shape[0]:
        raise SpecdraftError(f"{kind} head positions must be below {head.rope_cos.shape[0]}")
    cos = head.rope_cos[positions].unsqueeze(1).to(head.dtype)  # (T, 1, hd/2)
    sin = head.rope_sin[positions].unsqueeze(1).to(head.dtype)  # (T, 1, hd/2)
    if mask is None:
        return LayerStep(start, cos, sin, causal_mask(start, steps, groups, device))
    if mask.shape != (steps, start + steps):
        raise SpecdraftError(f"{kind} tree mask must be ({steps}, {start + steps}), got {tuple(mask.shape)}")
    return LayerStep(start, cos, sin, mask.to(device).repeat(groups, 1), explicit=True)
