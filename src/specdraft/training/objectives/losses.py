"""Distillation losses for aligning a draft model to a target (Goel et al. 2024, "Direct Alignment of Draft Model
for Speculative Decoding with Chat-Fine-Tuned LLMs", arXiv 2403.00858).

Glossary: p = target distribution, q = draft distribution, both over a vocabulary of V tokens at each position.

Every loss is a small pure function of ``draft_logits`` (N, V) or (B, T, V) (with grad), the target's logits
(no grad) or the data labels, and an optional ``mask`` (N,) or (B, T) bool, True where a response token counts.
Conventions shared by all of them:

- The math runs in float32 whatever the input dtype (bf16 logits from autocast are upcast once).
- The result is the mean of the per-position loss over counted positions. Masked positions are dropped before
  any arithmetic, so their logits (even NaN or inf) cannot touch the value or the gradient.
- An all-False mask returns ``0.0`` still attached to the graph (``backward()`` works and gives zero gradients),
  so a batch without response tokens is a no-op step rather than a crash; log the count if it matters.

The registry. :data:`LOSSES` maps each name to its :class:`Loss`: the function, what it compares q with (the
target's logits, or the data's tokens for cross-entropy), its settings (:class:`LossOption`) and whether online
distillation (``serve --online-distill``) and EAGLE-3 heads can train with it. ``finetune --loss`` and its option
flags, ``serve --online-loss`` and ``train-heads --kind eagle3 --options loss=...`` all read it, so a new loss is one
function here under :func:`register`, plus its test. :func:`distillation_loss` is the trainer's single entry point.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdraft.errors import SpecdraftError

WEIGHTINGS = ("q", "sample")
NORMALIZATIONS = ("none", "vocab", "batch")
REFERENCES = ("target", "labels")  # what a loss compares q with: the target's logits, or the data's tokens


@dataclass(frozen=True)
class LossOption:
    """One setting of a loss: a finetune flag (``--NAME``) and recipe key, a ``NAME=VALUE`` option of online
    distillation and of EAGLE-3 heads. ``choices`` for a word; else a number in [``low``, ``high``] (``high``
    excluded when ``open_high``)."""

    name: str
    default: float | str
    help: str
    choices: tuple[str, ...] = ()
    low: float = -math.inf
    high: float = math.inf
    open_high: bool = False

    def parse(self, value: object, where: str) -> float | str:
        """``value`` (a setting, or the text of ``NAME=VALUE``) as this option's type, checked; a bad one raises
        :class:`SpecdraftError` naming ``where`` and the option."""
        if self.choices:
            if value not in self.choices:
                raise SpecdraftError(f"{where} option {self.name} must be one of {', '.join(self.choices)}, "
                                     f"got {value!r}")
            return value
        try:
            number = float(value) if not isinstance(value, bool) else math.nan
        except (TypeError, ValueError):
            number = math.nan
        inside = self.low <= number and (number < self.high if self.open_high else number <= self.high)
        if not inside:
            bounds = f"[{self.low:g}, {self.high:g}{')' if self.open_high else ']'}"
            raise SpecdraftError(f"{where} option {self.name} must be a number in {bounds}, got {value!r}")
        return number


@dataclass(frozen=True)
class Loss:
    """A registered loss (see :func:`register`).

    Attributes:
        name: the name every front takes (``--loss NAME``, ``--online-loss NAME``, ``loss=NAME``).
        function: ``function(draft_logits, reference, mask, **options) -> float32 scalar``.
        reference: "target" (compares q with the target's logits p) or "labels" (with the data's tokens).
        options: its settings; the function's other keyword-only parameters (``eps``, ``generator``) are not.
        online: online distillation can train with it (it compares with p, rebuilt from the stored top-k).
        eagle3: EAGLE-3 heads can train with it (on p and q restricted to the draft vocabulary).
        summary: one line for help texts.
    """

    name: str
    function: Callable[..., torch.Tensor]
    reference: str
    options: tuple[LossOption, ...]
    online: bool
    eagle3: bool
    summary: str

    @property
    def needs_target(self) -> bool:
        """Whether the loss reads the target's distributions (else only the data's tokens)."""
        return self.reference == "target"

    @property
    def takes_generator(self) -> bool:
        """Whether the function draws randomness (a ``generator`` keyword)."""
        return "generator" in inspect.signature(self.function).parameters

    def settings(self, given: Mapping[str, object] | None = None, where: str | None = None) -> dict:
        """Every setting of the loss: the ``given`` values (settings, or ``NAME=VALUE`` texts) parsed and checked,
        the rest at their defaults. A name the loss does not take raises, naming the ones it does."""
        given, where = dict(given or {}), where or f"loss {self.name}"
        names = [option.name for option in self.options]
        unknown = sorted(set(given) - set(names))
        if unknown:
            takes = f"its options are {', '.join(names)}" if names else "it takes no option"
            raise SpecdraftError(f"{where} has no option {unknown[0]!r}; {takes}")
        return {o.name: o.parse(given[o.name], where) if o.name in given else o.default for o in self.options}

    def __call__(self, draft_logits: torch.Tensor, target_logits: torch.Tensor | None = None,
                 labels: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                 **options: object) -> torch.Tensor:
        """The loss of ``draft_logits`` against ``target_logits`` or ``labels`` (its :attr:`reference`); shapes
        as in :func:`cross_entropy`. ``options``: keyword-only parameters of :attr:`function`."""
        accepted = [p.name for p in inspect.signature(self.function).parameters.values() if p.kind is p.KEYWORD_ONLY]
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise SpecdraftError(f"loss {self.name!r} has no option {unknown[0]!r}; its options are {accepted}")
        reference, what = (target_logits, "target_logits") if self.needs_target else (labels, "labels")
        if reference is None:
            raise SpecdraftError(f"loss {self.name!r} needs {what}, got None")
        return self.function(draft_logits, reference, mask, **options)


LOSSES: dict[str, Loss] = {}  # name -> Loss, in the order registered


def register(name: str, *, summary: str, reference: str = "target", options: tuple[LossOption, ...] = (),
             online: bool = False, eagle3: bool = False) -> Callable[[Callable], Callable]:
    """Register the decorated function as the loss ``name`` in :data:`LOSSES`. An option shared by several losses
    must be the same :class:`LossOption` (one setting, one meaning); online and EAGLE-3 losses compare with p."""
    if reference not in REFERENCES:
        raise ValueError(f"loss {name}: reference must be one of {REFERENCES}")
    if (online or eagle3) and reference != "target":
        raise ValueError(f"loss {name}: online distillation and EAGLE-3 train against p (reference 'target')")

    def add(function: Callable) -> Callable:
        if name in LOSSES:
            raise ValueError(f"loss {name} is registered twice")
        known = all_options()
        clash = [o.name for o in options if o.name in known and known[o.name] != o]
        if clash:
            raise ValueError(f"loss {name}: option {clash[0]} already means something else")
        keyword = {p.name for p in inspect.signature(function).parameters.values() if p.kind is p.KEYWORD_ONLY}
        if not {o.name for o in options} <= keyword:
            raise ValueError(f"loss {name}: every option must be a keyword-only parameter of {function.__name__}")
        LOSSES[name] = Loss(name, function, reference, tuple(options), online, eagle3, summary)
        return function

    return add


def all_options() -> dict[str, LossOption]:
    """Every option of the registered losses, by name (a settings class exposes each once)."""
    return {option.name: option for loss in LOSSES.values() for option in loss.options}


def users(option: str) -> list[str]:
    """The names of the losses that take the option ``option``."""
    return [loss.name for loss in LOSSES.values() if any(o.name == option for o in loss.options)]


def loss_names(*, online: bool = False, eagle3: bool = False) -> tuple[str, ...]:
    """The registered names, or those online distillation / EAGLE-3 heads can train with."""
    return tuple(name for name, loss in LOSSES.items() if (loss.online or not online) and (loss.eagle3 or not eagle3))


def get_loss(name: str, *, online: bool = False, eagle3: bool = False, where: str = "loss") -> Loss:
    """The registered loss ``name``, refused (naming the choices) unless it is one of :func:`loss_names`."""
    names = loss_names(online=online, eagle3=eagle3)
    if name not in names:
        raise SpecdraftError(f"{where} must be one of {', '.join(names)}, got {name!r}")
    return LOSSES[name]


BETA = LossOption("beta", 0.5, "weight of p in the mixture", low=0.0, high=1.0)
WEIGHTING = LossOption("weighting", "q", f"{' or '.join(WEIGHTINGS)}", choices=WEIGHTINGS)
NORMALIZATION = LossOption("normalization", "batch", f"{', '.join(NORMALIZATIONS)}", choices=NORMALIZATIONS)
ALPHA = LossOption("alpha", 0.1, "skew: the share of the other distribution in the mixture (0 = plain KL)",
                   low=0.0, high=1.0, open_high=True)


@register("ce", summary="cross-entropy on the data's tokens", reference="labels")
def cross_entropy(draft_logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy on the data tokens: mean over counted positions of ``-log q(label)``.

    Args:
        draft_logits: (N, V) or (B, T, V) draft logits.
        labels: (N,) or (B, T) long, the next data token at each position.
        mask: (N,) or (B, T) bool, True where the position counts; None counts every position.
    Returns:
        float32 scalar.
    """
    _check_same_positions(draft_logits, labels, "labels")
    draft = _counted_rows(draft_logits, mask)  # (n, V)
    tokens = labels.reshape(-1)  # (N,)
    if mask is not None:
        tokens = tokens[_flat_mask(mask, draft_logits)]  # (n,)
    per_position = F.cross_entropy(draft, tokens, reduction="none")  # (n,)
    return _mean(per_position)


@register("fkl", summary="forward KL(p || q)", online=True, eagle3=True)
def forward_kl(
    draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Forward KL(p ‖ q) = Σ_x p(x) (log p(x) − log q(x)), mass-covering; masked mean over positions.

    Terms with p(x) = 0 are 0 (the limit of p log p). Shapes as in :func:`cross_entropy`; returns a float32 scalar.
    """
    log_q, log_p = _log_probs(draft_logits, target_logits, mask)  # (n, V) each
    return _mean(_kl(log_p, log_q))


@register("rkl", summary="reverse KL(q || p)")
def reverse_kl(
    draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Reverse KL(q ‖ p) = Σ_x q(x) (log q(x) − log p(x)), mode-seeking; masked mean over positions.

    Shapes as in :func:`cross_entropy`; returns a float32 scalar.
    """
    log_q, log_p = _log_probs(draft_logits, target_logits, mask)  # (n, V) each
    return _mean(_kl(log_q, log_p))


@register("jsd", summary="generalized Jensen-Shannon divergence (GKD)", options=(BETA,))
def jsd(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    beta: float = 0.5,
) -> torch.Tensor:
    """Generalized Jensen-Shannon divergence of GKD (Agarwal et al. 2024), TRL's ``generalized_jsd_loss``.

        m = β p + (1 − β) q
        JSD(β) = β KL(p ‖ m) + (1 − β) KL(q ‖ m)          for 0 < β < 1
        JSD(0) = KL(p ‖ q)  (forward KL),   JSD(1) = KL(q ‖ p)  (reverse KL)

    The endpoints are special-cased exactly as TRL does. They are not the limits of the middle formula, which
    tends to 0 at both ends (JSD(β) ≈ β KL(p ‖ q) as β → 0 and ≈ (1 − β) KL(q ‖ p) as β → 1): beta near an
    endpoint behaves like that KL direction, but at a scale of β (or 1 − β). Swapping p with q and β with 1 − β
    leaves the value unchanged; β = 0.5 is the symmetric Jensen-Shannon divergence (at most log 2).

    Args:
        beta: weight of p in the mixture, 0 ≤ β ≤ 1.
    Shapes as in :func:`cross_entropy`; returns a float32 scalar.
    """
    if not isinstance(beta, (int, float)) or math.isnan(beta) or not 0.0 <= beta <= 1.0:
        raise SpecdraftError(f"jsd option beta must be a number in [0, 1], got {beta!r}")
    log_q, log_p = _log_probs(draft_logits, target_logits, mask)  # (n, V) each
    if beta == 0.0:
        return _mean(_kl(log_p, log_q))
    if beta == 1.0:
        return _mean(_kl(log_q, log_p))
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1.0 - beta)]), dim=0)  # (n, V)
    return _mean(beta * _kl(log_p, log_m) + (1.0 - beta) * _kl(log_q, log_m))


@register("tvd", summary="total variation distance", online=True, eagle3=True)
def tvd(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Total variation distance TVD(p, q) = ½ Σ_x |p(x) − q(x)| ∈ [0, 1]; masked mean over positions.

    1 − TVD is the expected acceptance rate of speculative sampling at that position (Leviathan et al. 2023,
    Sec. 3), so this is also the value to log when training with :func:`tvd_plus_plus`.
    Shapes as in :func:`cross_entropy`; returns a float32 scalar.
    """
    log_q, log_p = _log_probs(draft_logits, target_logits, mask)  # (n, V) each
    return _mean(0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1))


@register("tvdpp", summary="TVD++ (Goel et al. 2024)", options=(WEIGHTING, NORMALIZATION), online=True,
          eagle3=True)
def tvd_plus_plus(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    weighting: str = "q",
    normalization: str = "batch",
    eps: float = 1e-6,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """TVD++ (Goel et al. 2024): a surrogate whose gradient is a normalised policy gradient of TVD.

    Derivation. Since Σ_x p(x) = Σ_x q(x) = 1, TVD = ½ Σ_x |p(x) − q(x)| = Σ_x max(0, q(x) − p(x)), so (away from
    ties p(x) = q(x)) and using Σ_x ∇q(x) = 0:

        ∇TVD = Σ_x 1{q(x) > p(x)} ∇q(x) = −Σ_x 1{p(x) > q(x)} ∇q(x) = −E_{x∼q}[r(x) ∇log q(x)],
        with reward r(x) = 1{p(x) > q(x)}.

    TVD++ replaces r by the advantage A = (r − mean) / (std + eps), the baseline and reward normalisation that
    reduce policy-gradient variance. The paper's exact estimator is not published, so the choices are options:

    - ``weighting="q"``: exact expectation over the vocabulary, surrogate −Σ_x sg[q(x) A(x)] log q(x)
      (sg = stop-gradient). ``"sample"``: Monte Carlo, one token x ∼ q per counted position drawn with
      ``generator`` (required), surrogate −sg[A(x)] log q(x).
    - ``normalization="none"``: A = r. ``"vocab"``: per position, mean = Σ_x q r and
      std = sqrt(Σ_x q (r − mean)²), the reward's statistics under q (computed exactly, for both weightings).
      ``"batch"``: one mean and std over all counted positions: for ``"q"`` the q-weighted statistics pooled over
      positions, for ``"sample"`` those of the sampled rewards.

    What the options really do under ``weighting="q"``: a baseline constant over a position's vocabulary changes
    nothing, because Σ_x q(x) ∇log q(x) = Σ_x ∇q(x) = 0; only the std scaling matters. ``"none"`` is exactly
    ∇TVD; ``"vocab"`` divides each position's ∇TVD by that position's std (re-weighting positions, which is no
    longer the gradient of mean TVD); ``"batch"`` multiplies the whole ∇TVD by one positive number,
    1 / (sqrt(μ(1 − μ)) + eps) with μ the q-mass on tokens where p > q, averaged over positions. Under
    ``"sample"`` the baseline does reduce variance (``"none"`` and ``"vocab"`` are unbiased for those same
    gradients; ``"batch"`` uses self-normalised statistics, as PPO's advantage normalisation does).

    Default ``weighting="q", normalization="batch"``: the full logits are already in memory, so the exact
    expectation costs no more than a sample and has no sampling variance; batch normalisation is TVD++'s reward
    normalisation in its usual policy-gradient form, and under exact weighting it provably keeps the direction
    of ∇TVD (so training still minimises TVD) while enlarging the step as the draft approaches the target and
    the raw TVD gradient fades. Its scale depends on the batch, so gradient-accumulation micro-batches are scaled
    separately.

    The returned scalar is the surrogate, not TVD (e.g. it can be 0 or negative); log :func:`tvd` for the value.

    Args:
        weighting: "q" or "sample".
        normalization: "none", "vocab" or "batch".
        eps: added to the std before dividing.
        generator: the randomness for ``weighting="sample"``; the draw is made on its device (a CPU generator
            with CUDA logits draws on the CPU, so a run's draws resume on any device).
    Shapes as in :func:`cross_entropy`; returns a float32 scalar.
    """
    if weighting not in WEIGHTINGS:
        raise SpecdraftError(f"tvdpp option weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    if normalization not in NORMALIZATIONS:
        raise SpecdraftError(f"tvdpp option normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    if weighting == "sample" and generator is None:
        raise SpecdraftError("tvdpp option generator is required with weighting='sample'")
    log_q, log_p = _log_probs(draft_logits, target_logits, mask)  # (n, V) each
    q = log_q.detach().exp()  # (n, V)
    reward = (log_p.exp() > q).float()  # (n, V), r(x) = 1{p(x) > q(x)}
    if weighting == "q":
        advantage = _q_advantage(reward, q, normalization, eps)  # (n, V)
        return _mean(-(q * advantage * log_q).sum(-1))
    tokens = torch.multinomial(q.to(generator.device), 1, generator=generator).to(q.device)  # (n, 1), x ∼ q
    advantage = _sampled_advantage(reward, q, tokens, normalization, eps)  # (n,)
    return _mean(-advantage * log_q.gather(-1, tokens).squeeze(-1))


@register("skl", summary="skew KL(p || a p + (1 - a) q) (DistiLLM)", options=(ALPHA,), online=True, eagle3=True)
def skew_kl(
    draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor | None = None, *, alpha: float = 0.1
) -> torch.Tensor:
    """α-skew forward KL of DistiLLM (Ko et al. 2024, "DistiLLM: Towards Streamlined Distillation for Large Language
    Models", arXiv 2402.03898; default α = 0.1 as there):

        SKL_α(p ‖ q) = KL(p ‖ α p + (1 − α) q) = Σ_x p(x) (log p(x) − log(α p(x) + (1 − α) q(x)))

    α = 0 is forward KL(p ‖ q) exactly (special-cased); α → 1 tends to 0. Mixing p into q bounds the log ratio by
    −log α where q(x) ≈ 0 < p(x), the terms that make forward KL's gradient spike: DistiLLM's reason for the skew.
    Masked mean over positions; shapes as in :func:`cross_entropy`; returns a float32 scalar.

    Args:
        alpha: weight of p in the mixture, 0 ≤ α < 1.
    """
    log_q, log_p = _log_probs(draft_logits, target_logits, mask)  # (n, V) each
    return _mean(_kl(log_p, _skewed(log_p, log_q, _check_alpha(alpha, "skl"))))


@register("srkl", summary="skew reverse KL(q || (1 - a) p + a q) (DistiLLM)", options=(ALPHA,), online=True,
          eagle3=True)
def skew_reverse_kl(
    draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor | None = None, *, alpha: float = 0.1
) -> torch.Tensor:
    """α-skew reverse KL of DistiLLM (Ko et al. 2024, arXiv 2402.03898; default α = 0.1 as there):

        SRKL_α(q ‖ p) = KL(q ‖ (1 − α) p + α q) = Σ_x q(x) (log q(x) − log((1 − α) p(x) + α q(x)))

    α = 0 is reverse KL(q ‖ p) exactly (special-cased); α → 1 tends to 0. The mixture keeps log p's tail, where the
    target gives a token almost nothing, from dominating a mode-seeking loss.
    Masked mean over positions; shapes as in :func:`cross_entropy`; returns a float32 scalar.

    Args:
        alpha: weight of q in the mixture, 0 ≤ α < 1.
    """
    log_q, log_p = _log_probs(draft_logits, target_logits, mask)  # (n, V) each
    return _mean(_kl(log_q, _skewed(log_q, log_p, _check_alpha(alpha, "srkl"))))


def distillation_loss(
    name: str,
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor | None,
    labels: torch.Tensor | None,
    mask: torch.Tensor | None = None,
    **options: object,
) -> torch.Tensor:
    """The loss called ``name`` in :data:`LOSSES`, against ``labels`` or the target as it says
    (:attr:`Loss.reference`).

    Args:
        name: a key of :data:`LOSSES`.
        draft_logits: (N, V) or (B, T, V) draft logits.
        target_logits: same shape, target logits (no grad); may be None for a loss on the labels.
        labels: (N,) or (B, T) long data tokens; may be None for a loss on the target.
        mask: (N,) or (B, T) bool, True where a response token counts.
        options: the loss's keyword-only parameters: its settings (``beta`` for jsd; ``weighting``,
            ``normalization`` for tvdpp; ``alpha`` for skl and srkl), and ``eps``, ``generator`` for tvdpp.
    Returns:
        float32 scalar.
    """
    if name not in LOSSES:
        raise SpecdraftError(f"unknown loss {name!r}; choose one of {sorted(LOSSES)}")
    return LOSSES[name](draft_logits, target_logits, labels, mask, **options)


def _check_alpha(alpha: float, name: str) -> float:
    return float(ALPHA.parse(alpha, name))


def _skewed(log_a: torch.Tensor, log_b: torch.Tensor, alpha: float) -> torch.Tensor:
    """log(α a + (1 − α) b) per entry (n, V), from log a and log b; exactly log b at α = 0."""
    if alpha == 0.0:
        return log_b
    return torch.logsumexp(torch.stack([log_a + math.log(alpha), log_b + math.log(1.0 - alpha)]), dim=0)


def _q_advantage(reward: torch.Tensor, q: torch.Tensor, normalization: str, eps: float) -> torch.Tensor:
    """A(x) for every token (n, V): r itself, or r standardised by q-weighted statistics per position or pooled."""
    if normalization == "none":
        return reward
    dims = (-1,) if normalization == "vocab" else (0, 1)
    return _standardize(reward, q, dims, eps)


def _sampled_advantage(
    reward: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor, normalization: str, eps: float
) -> torch.Tensor:
    """A(x) at the sampled token of each position (n,); "batch" standardises the sampled rewards themselves."""
    if normalization == "batch":
        sampled = reward.gather(-1, tokens).squeeze(-1)  # (n,)
        return _standardize(sampled, torch.ones_like(sampled), (0,), eps)
    return _q_advantage(reward, q, normalization, eps).gather(-1, tokens).squeeze(-1)


def _standardize(values: torch.Tensor, weights: torch.Tensor, dims: tuple[int, ...], eps: float) -> torch.Tensor:
    """(v − mean) / (std + eps) with the weighted mean Σ w v / Σ w and std sqrt(Σ w (v − mean)² / Σ w) over dims."""
    total = weights.sum(dims, keepdim=True)
    mean = (weights * values).sum(dims, keepdim=True) / total
    std = ((weights * (values - mean) ** 2).sum(dims, keepdim=True) / total).sqrt()
    return (values - mean) / (std + eps)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a ‖ b) = Σ_x a(x) (log a(x) − log b(x)) per row (n, V) -> (n,), with 0 where a(x) = 0."""
    a = log_a.exp()
    return (a * torch.where(a > 0, log_a - log_b, 0.0)).sum(-1)


def _log_probs(
    draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log q, log p) in float32 at the counted positions, each (n, V); the target side carries no grad."""
    if target_logits.shape != draft_logits.shape:
        raise SpecdraftError(
            f"target_logits shape {tuple(target_logits.shape)} != draft_logits shape {tuple(draft_logits.shape)}"
        )
    log_q = F.log_softmax(_counted_rows(draft_logits, mask), dim=-1)
    log_p = F.log_softmax(_counted_rows(target_logits.detach(), mask), dim=-1)
    return log_q, log_p


def _counted_rows(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Logits (..., V) -> (n, V) float32 rows of the counted positions."""
    rows = logits.reshape(-1, logits.shape[-1])  # (N, V)
    if mask is not None:
        rows = rows[_flat_mask(mask, logits)]
    return rows.float()


def _flat_mask(mask: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Validate ``mask`` against the positions of ``logits`` (..., V) and flatten it to (N,) bool."""
    if mask.dtype != torch.bool:
        raise SpecdraftError(f"mask must be a bool tensor, got {mask.dtype}")
    _check_same_positions(logits, mask, "mask")
    return mask.reshape(-1)


def _check_same_positions(logits: torch.Tensor, per_position: torch.Tensor, what: str) -> None:
    if per_position.shape != logits.shape[:-1]:
        raise SpecdraftError(f"{what} shape {tuple(per_position.shape)} != logits positions {tuple(logits.shape[:-1])}")


def _mean(per_position: torch.Tensor) -> torch.Tensor:
    """Mean of (n,) over counted positions; 0.0 attached to the graph when n = 0."""
    return per_position.sum() / max(per_position.shape[0], 1)
