"""Training GliDe draft models (Du et al. 2024, arXiv 2402.02082): ``specdraft train-heads --kind glide``.

The data is a distill-data folder (the target's own responses). For every batch the frozen transformers target runs
once under ``no_grad`` and gives its cache of the glimpse layer (the keys, rotated, and values the draft reads) and
its next-token distributions p. The draft is then unrolled ``ttt_steps`` depths from every root
(:func:`specdraft.heads.glide.unroll`): depth i+1 from root t reads x_{t+i}, the target's keys before t, and predicts
x_{t+i+1}, trained towards p at position t + i with the forward KL(p || q) over the full vocabulary; the loss is
sum_i decay^i KL_i. Positions count where the predicted token is a response token.

Held-out metrics: the loss, ``heldout_top1_depth{i}`` (agreement of depth i's greedy draft with the target's greedy
token, teacher-forced on the held-out text) and ``greedy_tau@k`` with ``greedy_first_accept@k``: greedy chain
decoding replayed over the held-out responses at γ = k (:func:`chain_tau`), exact when they are the target's own
greedy text.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdraft.heads.glide import GlideHead, build_glide, glide_spec, unroll
from specdraft.models.shared_embeddings import target_weights
from specdraft.training.heads.kinds import HeadKind
from specdraft.training.objectives.losses import forward_kl
from specdraft.training.objectives.tau import chain_tau

EXACT_DEPTHS = 4  # greedy_tau@k for k = 1 .. 4


def pair_roots(mask: torch.Tensor) -> torch.Tensor:
    """(B, L) bool: root t's next token x_{t+1} is a response token, from a collated batch's ``mask`` (B, L - 1)
    over its labels."""
    return torch.cat([mask, mask.new_zeros(mask.shape[0], 1)], dim=1)


def _spec(target_config, config, options: dict[str, str]) -> dict:
    return glide_spec(target_config, options)


@torch.no_grad()
def _init(module: GlideHead, target_model) -> None:
    """The final norm starts as the target's (the LM head it feeds is the target's)."""
    norm = getattr(getattr(target_model, "model", target_model), "norm", None)
    if norm is not None and getattr(norm, "weight", None) is not None:
        module.norm.copy_(norm.weight.float())


@torch.no_grad()
def teacher(target_model, tokens: torch.Tensor, seen: torch.Tensor, layer: int
            ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The frozen transformers target on right-padded ``tokens`` (B, L): its cache of ``layer`` (keys rotated,
    values; (B, K, L, hd) each) and its final-normed hidden states (B, L, D)."""
    out = target_model.model(input_ids=tokens, attention_mask=seen, use_cache=True)
    cached = out.past_key_values.layers[layer]
    return (cached.keys, cached.values), out.last_hidden_state


def _sequences(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole sequences (B, L) and their attention mask, from a collated distill batch."""
    tokens = torch.cat([batch["input_ids"][:, :1], batch["labels"]], dim=1)  # (B, L)
    seen = torch.cat([batch["attention_mask"][:, :1], batch["attention_mask"]], dim=1)  # (B, L)
    return tokens, seen


def _shift(mask: torch.Tensor, by: int) -> torch.Tensor:
    """mask[:, by:] right-padded with False back to its length."""
    return torch.cat([mask[:, by:], mask.new_zeros(mask.shape[0], min(by, mask.shape[1]))], dim=1)


def unrolled(module: GlideHead, target_model, batch: dict, steps: int):
    """Teacher and unroll on a collated batch. Returns the sequences (B, L), the roots (B, L) whose next token is a
    response token, the target's LM head (V, D) and, per depth i (lists of ``steps``): the counted roots (B, L) and,
    there, the draft's hidden states (n_i, D) and the target's (n_i, D), each giving logits through the LM head."""
    head = getattr(module, "module", module)
    tokens, seen = _sequences(batch)
    target_kv, final = teacher(target_model, tokens, seen, head.glimpse_layer)
    embed, lm_head = target_weights(target_model)
    hidden = unroll(head, F.embedding(tokens, embed.detach()), target_kv, steps)  # steps x (B, L, D)
    roots = pair_roots(batch["mask"])  # (B, L)
    masks = [_shift(roots, i) & roots for i in range(steps)]  # depth i+1 from t predicts x_{t+i+1}: a response token
    draft = [h[m] for h, m in zip(hidden, masks, strict=True)]  # (n_i, D) each
    target = [_shift_rows(final, i)[m] for i, m in enumerate(masks)]  # (n_i, D) each: p of x_{t+i+1}
    return tokens, roots, lm_head.detach(), masks, draft, target


def _shift_rows(x: torch.Tensor, by: int) -> torch.Tensor:
    """x[:, by:] (B, L, ...) right-padded with zeros back to its length."""
    if by == 0:
        return x
    return torch.cat([x[:, by:], x.new_zeros(x.shape[0], min(by, x.shape[1]), *x.shape[2:])], dim=1)


def _logits(rows: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """(n, D) -> (n, V) float32 through the target's LM head."""
    return F.linear(rows, lm_head.to(rows.dtype)).float()


def depth_loss(decay: float, draft: list[torch.Tensor], target: list[torch.Tensor],
               lm_head: torch.Tensor) -> tuple[torch.Tensor, int]:
    """sum_i decay^i KL(p_i || q_i) over the depths' counted rows (hidden states (n_i, D) of the draft and the
    target, through ``lm_head``); returns (loss, depth-1 rows)."""
    total = draft[0].sum() * 0.0
    for i, (q, p) in enumerate(zip(draft, target, strict=True)):
        if q.shape[0]:
            total = total + forward_kl(_logits(q, lm_head), _logits(p, lm_head)) * decay**i
    return total, int(draft[0].shape[0])


def _loss(module, target_model, batch: dict, generator: torch.Generator | None = None) -> tuple[torch.Tensor, int]:
    settings = getattr(module, "module", module).train_settings
    _, _, lm_head, _, draft, target = unrolled(module, target_model, batch, settings["ttt_steps"])
    return depth_loss(settings["decay"], draft, target, lm_head)


@torch.no_grad()
def _metrics(module: GlideHead, target_model, batch: dict) -> dict[str, tuple[float, int]]:
    """Held-out loss, per-depth top-1 agreement with the target's greedy token, and the exact greedy chain τ at
    γ = 1 .. :data:`EXACT_DEPTHS`."""
    settings = module.train_settings
    depths = settings["ttt_steps"]
    _, roots, lm_head, masks, draft, target = unrolled(module, target_model, batch, max(depths, EXACT_DEPTHS))
    loss, count = depth_loss(settings["decay"], draft[:depths], target[:depths], lm_head)
    metrics = {"heldout_loss": (float(loss) * count, count)}
    right = []  # (B, L) each: depth i's draft from root t is the target's greedy token there
    for i, (q, p, mask) in enumerate(zip(draft, target, masks, strict=True)):
        hits = _logits(q, lm_head).argmax(-1) == _logits(p, lm_head).argmax(-1)  # (n_i,)
        metrics[f"heldout_top1_depth{i + 1}"] = (float(hits.sum()), int(hits.shape[0]))
        right.append(torch.zeros_like(mask).masked_scatter(mask, hits))
    metrics.update(chain_tau(right[:EXACT_DEPTHS], roots, range(1, EXACT_DEPTHS + 1)))
    return metrics


def _drafter(module: GlideHead):
    from specdraft.drafters.glide import GlideDrafter

    return GlideDrafter.from_module(module)


GLIDE = HeadKind(spec=_spec, build=build_glide, init=_init, loss=_loss, metrics=_metrics, drafter=_drafter)
