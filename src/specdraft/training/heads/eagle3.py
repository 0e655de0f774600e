"""Training EAGLE-3 heads (Li et al. 2025, arXiv 2503.01840): ``specdraft train-heads --kind eagle3``.

The data is a distill-data folder (the target's own responses). For every batch the frozen target runs once under
``no_grad`` and gives (i) the residual stream entering the ``aux_layers`` (the head's input, (B, L, 3D)) and (ii) its
next-token logits restricted to the draft vocabulary, p (B, L, N). The head is then unrolled for ``ttt_steps`` steps
on its own features (training-time test, :meth:`specdraft.heads.eagle3.Eagle3Head.unroll`): step i at pair t
reads token x_{t+1+i} and is trained towards p at position t+1+i, the target's distribution of x_{t+2+i}. The loss
is sum_i decay^i * loss_i (EAGLE-3 / SpecForge: decay 0.8), with loss_i any registered loss that EAGLE-3 can train
with (:func:`specdraft.training.objectives.losses.loss_names` with ``eagle3=True``; ``loss=NAME`` and the loss's
settings as options, e.g. ``loss=skl;alpha=0.2``) between q and p restricted to the draft vocabulary (p
renormalised there). The default ``fkl`` is SpecForge's soft cross-entropy up to p's entropy (SpecForge also skips
positions whose target argmax is not in the draft vocabulary, which needs the full LM head: here they count).

Positions count where token x_{t+1+i} is a response token. The draft vocabulary is the ``draft_vocab`` most
frequent tokens of the training responses (FR-Spec's ranking, :mod:`specdraft.draft_vocab`). The head's ``norm``
and ``lm_head`` start from the target's final norm and its LM head rows of the draft vocabulary.

Held-out metrics: the loss, top-1 agreement of each step's draft token with the target's greedy token
(``heldout_top1_step0`` is the first draft token's acceptance in greedy decoding when the context is the target's
own greedy text), and ``greedy_tau@k`` with ``greedy_first_accept@k``: greedy chain decoding replayed over the
held-out responses at γ = k from the unroll (:func:`~specdraft.training.objectives.tau.chain_tau`), exact when they
are the target's own greedy text. The generic trainer adds τ from real decoding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdraft.errors import SpecdraftError
from specdraft.heads.eagle import head_config
from specdraft.heads.eagle3 import Eagle3Head, build_eagle3, default_aux_layers
from specdraft.heads.fspad import parse_fspad, partial_smooth_l1
from specdraft.models.shared_embeddings import target_weights
from specdraft.training.data.records import load_distill_records, split_by_prompt
from specdraft.training.heads.kinds import HeadKind
from specdraft.training.objectives.losses import LOSSES, get_loss
from specdraft.training.objectives.tau import chain_tau

_OPTIONS = {"loss": "fkl", "ttt_steps": "7", "decay": "0.8", "draft_vocab": "8192", "aux_layers": "",
            "fspad_sampling": "0", "partial_alignment": "0", "align_weight": "1"}


def parse_settings(options: dict[str, str], num_layers: int, vocab_size: int) -> dict:
    """The ``--options`` of ``--kind eagle3`` (loss and its settings, ttt_steps, decay, draft_vocab,
    aux_layers='2,15,27', and FSPAD's fspad_sampling, partial_alignment with its align_weight:
    :mod:`specdraft.heads.fspad`), checked, with their defaults."""
    loss = get_loss(options.get("loss", _OPTIONS["loss"]), eagle3=True, where="eagle3 option loss")
    settings = {option.name for option in loss.options}
    unknown = sorted(set(options) - set(_OPTIONS) - settings)
    if unknown:
        raise SpecdraftError(f"unknown eagle3 option {', '.join(unknown)}; eagle3 takes: "
                             f"{', '.join([*_OPTIONS, *sorted(settings)])}")
    raw = _OPTIONS | options
    try:
        steps, decay, vocab = int(raw["ttt_steps"]), float(raw["decay"]), int(raw["draft_vocab"])
        layers = [int(i) for i in raw["aux_layers"].split(",")] if raw["aux_layers"] else default_aux_layers(num_layers)
    except ValueError:
        raise SpecdraftError(f"eagle3 options ttt_steps, draft_vocab, aux_layers need integers, decay a number: "
                             f"{options}") from None
    if steps < 1 or not 0 < decay <= 1 or vocab < 1:
        raise SpecdraftError(f"eagle3 needs ttt_steps >= 1, 0 < decay <= 1 and draft_vocab >= 1: {options}")
    if not layers or any(not 0 <= i < num_layers for i in layers) or layers != sorted(set(layers)):
        raise SpecdraftError(f"eagle3 aux_layers must be increasing layer indices in 0 .. {num_layers - 1}, "
                             f"got {layers}")
    fspad = parse_fspad(raw, "eagle3")
    try:
        weight = float(raw["align_weight"])
    except ValueError:
        weight = -1.0
    if not 0 <= weight < float("inf"):
        raise SpecdraftError(f"eagle3 option align_weight must be a finite number >= 0, got {raw['align_weight']!r}")
    loss_options = loss.settings({k: v for k, v in options.items() if k in settings}, f"eagle3 loss {loss.name}")
    return {"loss": loss.name, "loss_options": loss_options, "ttt_steps": steps, "decay": decay,
            "aux_layers": layers, "draft_vocab_size": min(vocab, vocab_size)} | fspad | {"align_weight": weight}


def _spec(target_config, config, options: dict[str, str]) -> dict:
    """Sizes from the target, settings from ``options`` and, under ``draft_token_ids`` (consumed by ``build``),
    the draft vocabulary: the most frequent tokens of the training split of ``config.data``."""
    from specdraft.draft_vocab import rank_tokens

    sizes = head_config(target_config)
    settings = parse_settings(options, target_config.num_hidden_layers, sizes["vocab_size"])
    records = load_distill_records(config.data, config.allow_incomplete)
    train, _ = split_by_prompt(records, config.heldout_every)
    ranking = rank_tokens((r["response_token_ids"] for r in train), sizes["vocab_size"])
    return sizes | settings | {"draft_token_ids": ranking[: settings["draft_vocab_size"]].tolist()}


def _build(spec: dict) -> Eagle3Head:
    """The head of a spec; a fresh spec's ``draft_token_ids`` set d2t / t2d and leave the spec (the saved spec
    holds only ``draft_vocab_size``: d2t and t2d live in the weights)."""
    ids = spec.pop("draft_token_ids", None)
    return build_eagle3(spec, None if ids is None else torch.tensor(ids))


@torch.no_grad()
def _init(module: Eagle3Head, target_model) -> None:
    """``norm`` and ``lm_head`` start as the target's final norm and its LM head's draft-vocabulary rows."""
    _, lm_head = target_weights(target_model)
    module.lm_head.weight.copy_(lm_head[module.draft_token_ids].float())
    norm = getattr(getattr(target_model, "model", target_model), "norm", None)
    if norm is not None and getattr(norm, "weight", None) is not None:
        module.norm.copy_(norm.weight.float())


@torch.no_grad()
def teacher(target_model, tokens: torch.Tensor, seen: torch.Tensor, aux_layers: list[int], draft_ids: torch.Tensor,
            greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The frozen transformers target on right-padded ``tokens`` (B, L): its features (B, L, kD) (the inputs of
    ``aux_layers``), its logits restricted to the draft vocabulary (B, L, N) and, if asked (the full vocabulary's
    LM head costs a fifth of SmolLM2's forward), its greedy tokens (B, L)."""
    out = target_model.model(input_ids=tokens, attention_mask=seen, output_hidden_states=True, use_cache=False)
    aux = torch.cat([out.hidden_states[i] for i in aux_layers], dim=-1)  # (B, L, kD)
    lm_head = target_model.get_output_embeddings().weight
    final = out.last_hidden_state  # (B, L, D), final-normed
    top = F.linear(final, lm_head).argmax(-1) if greedy else None  # (B, L)
    return aux, F.linear(final, lm_head[draft_ids]), top


def _shift(x: torch.Tensor, by: int, fill) -> torch.Tensor:
    """x[:, by:] right-padded with ``fill`` back to x's length (dim 1)."""
    if by == 0:
        return x
    pad = x.new_full((x.shape[0], min(by, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, by:], pad], dim=1)


def unrolled(module: Eagle3Head, target_model, batch: dict, steps: int, greedy: bool = False, align: bool = False):
    """The teacher and the head's TTT unroll on a collated distill batch, for the T = L - 1 pairs of the sequences.
    Returns per step i (lists of length ``steps``) the counted positions (B, T) bool and, at those n_i positions
    only (the LM heads skip the prompt), the draft logits (n_i, N), the target's restricted logits (n_i, N) and,
    with ``greedy``, its greedy tokens (n_i,) (else None); then, with ``align``, step 0's outputs g_t and the
    target's next fused features fc(a_{t+1}) (detached) at its counted positions, (n_0, D) each (else None)."""
    head, aux, p_logits, top, outputs = _unroll(module, target_model, batch, steps, greedy)
    return _select(head, aux, p_logits, top, outputs, batch["mask"], align)


def _unroll(module: Eagle3Head, target_model, batch: dict, steps: int, greedy: bool):
    """(head, the target's features (B, L, kD), its restricted logits (B, L, N), its greedy tokens (B, L) or None,
    the head's outputs per step (B, T, D) each) of :func:`unrolled`."""
    head = getattr(module, "module", module)
    if head is not module:
        raise SpecdraftError("eagle3 heads train in one process (its unroll bypasses DistributedDataParallel)")
    tokens = torch.cat([batch["input_ids"][:, :1], batch["labels"]], dim=1)  # (B, L)
    seen = torch.cat([batch["attention_mask"][:, :1], batch["attention_mask"]], dim=1)  # (B, L)
    aux, p_logits, top = teacher(target_model, tokens, seen, head.aux_layers, head.draft_token_ids, greedy)
    embed, _ = target_weights(target_model)
    embeds = [F.embedding(_shift(tokens[:, 1:], i, 0), embed.detach()) for i in range(steps)]  # (B, T, D) each
    return head, aux, p_logits, top, head.unroll(aux[:, :-1], embeds)


def _select(head: Eagle3Head, aux, p_logits, top, outputs, counted: torch.Tensor, align: bool = False):
    """:func:`unrolled`'s rows, with step 0 counted at the pairs ``counted`` (B, T) and step i at those i pairs
    before them (step i at pair t drafts the token step 0 drafts at pair t + i)."""
    masks = [_shift(counted, i, False) for i in range(len(outputs))]  # (B, T) each
    draft = [head.logits(out[mask]) for out, mask in zip(outputs, masks, strict=True)]  # (n_i, N) each
    target = [_shift(p_logits[:, 1:], i, 0.0)[mask] for i, mask in enumerate(masks)]  # (n_i, N) each
    tops = [_shift(top[:, 1:], i, -1)[mask] if top is not None else None for i, mask in enumerate(masks)]  # (n_i,)
    aligned = (outputs[0][masks[0]], head.fuse(aux[:, 1:]).detach()[masks[0]]) if align else None  # (n_0, D) each
    return masks, draft, target, tops, aligned


def ttt_loss(name: str, decay: float, draft: list[torch.Tensor], target: list[torch.Tensor],
             generator: torch.Generator | None = None, options: dict | None = None) -> tuple[torch.Tensor, int]:
    """sum_i decay^i loss_i over the TTT steps' counted rows (n_i, N) with the registered loss ``name`` and its
    settings ``options`` (see the module docstring); returns (loss, step-0 positions)."""
    loss = LOSSES[name]
    drawn = {"generator": generator} if loss.takes_generator and generator is not None else {}
    total = None
    for i, (q, p) in enumerate(zip(draft, target, strict=True)):
        value = loss(q, p, **(options or {}), **drawn)
        total = value * decay**i if total is None else total + value * decay**i
    return total, int(draft[0].shape[0])


def alignment_loss(settings: dict, aligned: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor | float:
    """FSPAD's partial alignment for EAGLE-3 (:mod:`specdraft.heads.fspad`): ``align_weight`` times the smooth L1
    of the first ceil(R*D) coordinates of step 0's outputs and the next fused features; 0 when R = 0."""
    if aligned is None or not aligned[0].shape[0]:
        return 0.0
    predicted, truth = aligned
    return settings["align_weight"] * partial_smooth_l1(predicted.float(), truth.float(),
                                                        settings["partial_alignment"])


def _loss(module, target_model, batch: dict, generator: torch.Generator | None = None) -> tuple[torch.Tensor, int]:
    settings = module.train_settings
    align = settings.get("partial_alignment", 0.0) > 0
    _, draft, target, _, aligned = unrolled(module, target_model, batch, settings["ttt_steps"], align=align)
    loss, count = ttt_loss(settings["loss"], settings["decay"], draft, target, generator,
                           settings.get("loss_options"))
    return loss + alignment_loss(settings, aligned), count


@torch.no_grad()
def _metrics(module: Eagle3Head, target_model, batch: dict) -> dict[str, tuple[float, int]]:
    """Held-out loss and per-step top-1 agreement with the target's greedy token on the training rows, and greedy
    chain decoding replayed from the rows decoding drafts from (:func:`_greedy_tau`)."""
    settings = module.train_settings
    steps = settings["ttt_steps"]
    align = settings.get("partial_alignment", 0.0) > 0
    parts = _unroll(module, target_model, batch, steps, greedy=True)
    masks, draft, target, tops, aligned = _select(*parts, batch["mask"], align)
    generator = torch.Generator(device=draft[0].device).manual_seed(0)  # a loss that samples: the same draws
    loss, count = ttt_loss(settings["loss"], settings["decay"], draft, target, generator, settings.get("loss_options"))
    metrics = {"heldout_loss": (float(loss + alignment_loss(settings, aligned)) * count, count)}
    for i, hits in enumerate(_agreement(module, draft, tops, masks)):
        metrics[f"heldout_top1_step{i}"] = (float(hits.sum()), int(masks[i].sum()))
    return metrics | _greedy_tau(module, parts, batch["mask"], steps)


def _agreement(module: Eagle3Head, draft: list[torch.Tensor], tops: list[torch.Tensor],
               masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per step, (B, T) bool: at its counted pairs, the draft token is the target's greedy token."""
    ids = module.draft_token_ids
    return [torch.zeros_like(mask).masked_scatter(mask, ids[q.argmax(-1)] == top)
            for q, top, mask in zip(draft, tops, masks, strict=True)]


def _greedy_tau(module: Eagle3Head, parts: tuple, mask: torch.Tensor, steps: int) -> dict[str, tuple[float, int]]:
    """``greedy_tau@k`` and ``greedy_first_accept@k`` for k in 3, 5 and ``ttt_steps`` (at most ``ttt_steps``).
    Decoding drafts response token j from pair s - 2 + j (s: the prompt's length; step 0 there reads the feature
    of the token before the last committed one, and that token), so the roots are the pairs whose next-but-one
    token is a response token: one pair before the training rows. A generation's first step drafts nothing (the
    drafter gets the prompt's features with its result), so nothing is accepted at each row's first root."""
    roots = _shift(mask, 1, False)  # (B, T): x_{t+2} is a response token
    first = roots & ~torch.cat([roots.new_zeros(roots.shape[0], 1), roots[:, :-1]], dim=1)  # (B, T)
    masks, draft, _, tops, _ = _select(*parts, roots)
    hits = [right & ~first for right in _agreement(module, draft, tops, masks)]
    return chain_tau(hits, roots, sorted({min(3, steps), min(5, steps), steps}))


def _drafter(module: Eagle3Head):
    from specdraft.drafters.eagle3 import Eagle3Drafter

    return Eagle3Drafter.from_module(module)


EAGLE3 = HeadKind(spec=_spec, build=_build, init=_init, loss=_loss, metrics=_metrics, drafter=_drafter)
