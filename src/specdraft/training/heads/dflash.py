"""Training a DFlash drafter (Chen et al. 2026, arXiv 2602.06036): ``specdraft train-heads --kind dflash``.

The data is a distill-data folder (the target's own responses). For every batch the frozen target runs once under
``no_grad`` and gives the residual stream after the ``target_layer_ids`` (B, L, kD) and its next-token logits on the
draft vocabulary, p (B, L, N). The recipe is the paper's (Sec. 4): ``blocks`` anchor positions a are drawn at random
per sequence among those whose next token is a response token (decoding anchors a block on the last committed
token, the prompt's last token included); block b is [x_a, MASK x (B - 1)] at positions a .. a + B - 1, its context
the features of positions < a, and row j (j = 1 .. B - 1) is trained towards p at position a + j - 1, the target's
distribution of x_{a+j} (counted while x_{a+j} is a response token). All blocks of a batch run in one forward: the
context keys and values of every position are computed once and one attention mask lets each block's rows see its
own context prefix and its own block (non-causal). The loss is sum_j w_j loss_j with position-decayed weights
w_j = exp(-(j - 1) / gamma) (the paper's; gamma 4 for blocks of 8: early positions decide the accepted length) and
loss_j any registered loss that EAGLE-3 trains with (:func:`specdraft.training.objectives.losses.loss_names`, default
``fkl``: forward KL to p renormalised on the draft vocabulary; ``tvd``), between q_j and p.

The draft vocabulary is the ``draft_vocab`` most frequent tokens of the training responses (FR-Spec's ranking,
:mod:`specdraft.draft_vocab`); ``norm`` and ``lm_head`` start from the target's final norm and its LM head rows of
the draft vocabulary, and ``mask_embedding`` from the mean of the target's embeddings.

Held-out metrics: the loss, per-position top-1 agreement with the target's greedy token (``heldout_top1_pos{j}``)
and ``greedy_tau@{B-1}``: 1 + the accepted prefix of the greedy block at each drawn anchor, the block efficiency of
greedy DFlash decoding at γ = B - 1 when the held-out responses are the target's own greedy text.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from specdraft.errors import SpecdraftError
from specdraft.heads.dflash import DFlashHead, build_dflash, default_target_layer_ids
from specdraft.heads.eagle import head_config
from specdraft.models.shared_embeddings import target_weights
from specdraft.training.data.records import load_distill_records, split_by_prompt
from specdraft.training.heads.eagle3 import teacher
from specdraft.training.heads.kinds import HeadKind
from specdraft.training.objectives.losses import LOSSES, get_loss

_OPTIONS = {"loss": "fkl", "block_size": "8", "blocks": "16", "gamma": "4", "draft_vocab": "8192",
            "target_layers": "", "layers": "1", "mask_token_id": ""}


def parse_settings(options: dict[str, str], num_layers: int, vocab_size: int) -> dict:
    """The ``--options`` of ``--kind dflash`` (loss and its settings, block_size, blocks per sequence, gamma,
    draft_vocab, target_layers='1,8,14,20,27' (0-based, the output of those target layers), layers (draft layers),
    mask_token_id), checked, with their defaults."""
    loss = get_loss(options.get("loss", _OPTIONS["loss"]), eagle3=True, where="dflash option loss")
    settings = {option.name for option in loss.options}
    unknown = sorted(set(options) - set(_OPTIONS) - settings)
    if unknown:
        raise SpecdraftError(f"unknown dflash option {', '.join(unknown)}; dflash takes: "
                             f"{', '.join([*_OPTIONS, *sorted(settings)])}")
    raw = _OPTIONS | options
    try:
        block, blocks, vocab, layers = (int(raw[k]) for k in ("block_size", "blocks", "draft_vocab", "layers"))
        gamma = float(raw["gamma"])
        ids = [int(i) for i in raw["target_layers"].split(",")] if raw["target_layers"] else \
            default_target_layer_ids(num_layers)
        mask = int(raw["mask_token_id"]) if raw["mask_token_id"] else vocab_size - 1
    except ValueError:
        raise SpecdraftError(f"dflash options block_size, blocks, draft_vocab, layers, target_layers, mask_token_id "
                             f"need integers, gamma a number: {options}") from None
    if block < 2 or blocks < 1 or vocab < 1 or layers < 1 or not gamma > 0 or not 0 <= mask < vocab_size:
        raise SpecdraftError(f"dflash needs block_size >= 2, blocks, draft_vocab, layers >= 1, gamma > 0 and a "
                             f"mask_token_id in the vocabulary: {options}")
    if not ids or any(not 0 <= i < num_layers - 1 for i in ids) or ids != sorted(set(ids)):
        raise SpecdraftError(f"dflash target_layers must be increasing layer indices in 0 .. {num_layers - 2} (the "
                             f"output of the last layer is not a feature), got {ids}")
    loss_options = loss.settings({k: v for k, v in options.items() if k in settings}, f"dflash loss {loss.name}")
    return {"loss": loss.name, "loss_options": loss_options, "block_size": block, "blocks": blocks, "gamma": gamma,
            "num_layers": layers, "target_layer_ids": ids, "mask_token_id": mask,
            "draft_vocab_size": min(vocab, vocab_size)}


def _spec(target_config, config, options: dict[str, str]) -> dict:
    """Sizes from the target, settings from ``options`` and, under ``draft_token_ids`` (consumed by ``build``), the
    draft vocabulary: the most frequent tokens of the training split of ``config.data``."""
    from specdraft.draft_vocab import rank_tokens

    sizes = head_config(target_config)
    settings = parse_settings(options, target_config.num_hidden_layers, sizes["vocab_size"])
    records = load_distill_records(config.data, config.allow_incomplete)
    train, _ = split_by_prompt(records, config.heldout_every)
    ranking = rank_tokens((r["response_token_ids"] for r in train), sizes["vocab_size"])
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings")
    return {k: sizes[k] for k in keep} | settings | {
        "draft_token_ids": ranking[: settings["draft_vocab_size"]].tolist()}


def _build(spec: dict) -> DFlashHead:
    """The head of a spec; a fresh spec's ``draft_token_ids`` set d2t and leave the spec."""
    ids = spec.pop("draft_token_ids", None)
    return build_dflash(spec, None if ids is None else torch.tensor(ids))


@torch.no_grad()
def _init(module: DFlashHead, target_model) -> None:
    """``norm`` / ``lm_head`` from the target's final norm and its LM head rows; the mask from the mean embedding."""
    embed, lm_head = target_weights(target_model)
    module.lm_head.weight.copy_(lm_head[module.d2t].float())
    module.mask_embedding.copy_(embed.float().mean(0))
    norm = getattr(getattr(target_model, "model", target_model), "norm", None)
    if norm is not None and getattr(norm, "weight", None) is not None:
        module.norm.weight.copy_(norm.weight.float())


def draw_anchors(counted: torch.Tensor, blocks: int, generator: torch.Generator | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``blocks`` distinct anchors per sequence among the positions ``counted`` (B, T) (the next token is a
    response token), drawn uniformly: (B, n) positions and (B, n) bool (False: padding, fewer positions)."""
    rows, valid = [], []
    for row in counted:
        where = row.nonzero().flatten()  # (m,)
        order = torch.randperm(where.numel(), generator=generator, device="cpu")[:blocks].to(where.device)
        chosen = where[order].sort().values
        rows.append(F.pad(chosen, (0, blocks - chosen.numel())))
        valid.append(torch.arange(blocks, device=row.device) < chosen.numel())
    return torch.stack(rows), torch.stack(valid)


def block_forward(module: DFlashHead, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                  embed: torch.Tensor) -> torch.Tensor:
    """Every block of a batch in one forward: ``features`` (B, L, kD) of the sequences ``tokens`` (B, L),
    ``anchors`` (B, n). Returns the final-normed block rows (B, n, block_size, D)."""
    batch, length = tokens.shape
    size, n = module.block_size, anchors.shape[1]
    g = module.encode(features)  # (B, L, D)
    context = module.context(g, torch.arange(length, device=tokens.device))  # per layer (B, K, L, hd)
    h = module.block_embeddings(tokens.gather(1, anchors), embed).reshape(batch, n * size, -1)  # (B, nS, D)
    positions = (anchors[..., None] + torch.arange(size, device=tokens.device)).reshape(batch, n * size)  # (B, nS)
    block_of = torch.arange(n * size, device=tokens.device) // size  # (nS,)
    sees_context = torch.arange(length, device=tokens.device) < anchors.repeat_interleave(size, 1)[..., None]
    sees_block = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)  # (B, nS, nS)
    mask = torch.cat([sees_context, sees_block], dim=-1)[:, None]  # (B, 1, nS, L + nS)
    return module(h, positions, context, mask).view(batch, n, size, -1)


def _rows(module: DFlashHead, target_model, batch: dict, generator: torch.Generator | None, greedy: bool = False):
    """Per block row j = 1 .. B-1: the counted (B, n) bool, the draft logits (m_j, N), the target's restricted logits
    (m_j, N) and, with ``greedy``, its greedy tokens (m_j,); then the anchors' validity (B, n)."""
    head = getattr(module, "module", module)
    if head is not module:
        raise SpecdraftError("dflash heads train in one process")
    tokens = torch.cat([batch["input_ids"][:, :1], batch["labels"]], dim=1)  # (B, L)
    seen = torch.cat([batch["attention_mask"][:, :1], batch["attention_mask"]], dim=1)  # (B, L)
    layers = [i + 1 for i in head.target_layer_ids]  # transformers' hidden_states[i + 1]: the output of layer i
    features, p_logits, top = teacher(target_model, tokens, seen, layers, head.d2t, greedy)
    embed, _ = target_weights(target_model)
    counted = batch["mask"].bool()  # (B, T): token t + 1 is a response token
    anchors, valid = draw_anchors(counted, head.train_settings["blocks"], generator)  # (B, n)
    hidden = block_forward(head, features, tokens, anchors, embed.detach())  # (B, n, S, D)
    out = []
    for j in range(1, head.block_size):
        where = anchors + j - 1  # (B, n): the position whose target distribution row j learns
        inside = where < counted.shape[1]
        rows = valid & inside & counted.gather(1, where.clamp(max=counted.shape[1] - 1))  # (B, n)
        p = p_logits.gather(1, where.clamp(max=p_logits.shape[1] - 1)[..., None].expand(-1, -1, p_logits.shape[-1]))
        greedy_rows = top.gather(1, where.clamp(max=top.shape[1] - 1))[rows] if top is not None else None
        out.append((rows, head.logits(hidden[:, :, j][rows]), p[rows], greedy_rows))
    return out, valid


def block_loss(settings: dict, rows: list, generator: torch.Generator | None = None) -> tuple[torch.Tensor, int]:
    """sum_j exp(-(j - 1) / gamma) loss_j over the rows of :func:`_rows`; returns (loss, counted row-1 positions)."""
    loss = LOSSES[settings["loss"]]
    drawn = {"generator": generator} if loss.takes_generator and generator is not None else {}
    total = None
    for j, (_, q, p, _) in enumerate(rows):
        if not q.shape[0]:
            continue
        value = loss(q, p, **(settings.get("loss_options") or {}), **drawn) * math.exp(-j / settings["gamma"])
        total = value if total is None else total + value
    if total is None:
        total = sum(q.sum() for _, q, _, _ in rows) * 0.0  # no counted row: a zero that keeps the graph
    return total, int(rows[0][1].shape[0])


def _loss(module, target_model, batch: dict, generator: torch.Generator | None = None) -> tuple[torch.Tensor, int]:
    """The block loss; the counted tokens are the batch's response tokens (what the frozen target read)."""
    rows, _ = _rows(module, target_model, batch, generator)
    loss, _ = block_loss(module.train_settings, rows, generator)
    return loss, int(batch["mask"].sum())


@torch.no_grad()
def _metrics(module: DFlashHead, target_model, batch: dict) -> dict[str, tuple[float, int]]:
    """Held-out loss, per-position top-1 agreement with the target's greedy token, and ``greedy_tau@{B-1}`` over
    the blocks drawn at fixed anchors (generator seeded 0)."""
    generator = torch.Generator().manual_seed(0)
    rows, valid = _rows(module, target_model, batch, generator, greedy=True)
    loss, count = block_loss(module.train_settings, rows, generator)
    metrics = {"heldout_loss": (float(loss) * count, count)}
    alive = valid.clone()  # (B, n): every earlier row of the block was right
    accepted = torch.zeros(valid.shape, device=valid.device)
    for j, (counted, q, _, greedy) in enumerate(rows, start=1):
        hits = torch.zeros_like(counted).masked_scatter(counted, module.d2t[q.argmax(-1)] == greedy)  # (B, n)
        metrics[f"heldout_top1_pos{j}"] = (float(hits.sum()), int(counted.sum()))
        alive = alive & hits
        accepted += alive.float()
    metrics[f"greedy_tau@{module.block_size - 1}"] = (float((1 + accepted)[valid].sum()), int(valid.sum()))
    return metrics


def _drafter(module: DFlashHead):
    from specdraft.drafters.dflash import DFlashDrafter

    return DFlashDrafter.from_module(module)


DFLASH = HeadKind(spec=_spec, build=_build, init=_init, loss=_loss, metrics=_metrics, drafter=_drafter)
