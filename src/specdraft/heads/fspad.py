"""FSPAD's two training options for feature-level heads (Gui et al. 2024, "Boosting Lossless Speculative Decoding via
Feature Sampling and Partial Alignment Distillation", arXiv 2408.15562), as this package implements them for the
EAGLE and EAGLE-3 heads (``specdraft train-heads --kind eagle|eagle3 --options 'fspad_sampling=M;
partial_alignment=R'``).

Feature sampling (``fspad_sampling`` = M > 0). A target feature f_t does not say which token the target went on to
emit; EAGLE pairs it with that token's embedding e_{t+1} (concatenation, then fc). FSPAD instead uses the token
embedding to sample the feature in a higher-dimensional space before the draft model reads it. Here:

    s_t = W_down (sigmoid(W_gate e_{t+1}) * W_up f_t)      W_up, W_gate: D -> M*D; W_down: M*D -> D (no biases)
    f'_t = f_t + s_t                                        what the head reads in place of f_t

The embedding gates every coordinate of the lifted feature, selecting the part consistent with the emitted token.
``W_down`` starts at zero, so a head starts exactly as its baseline; 3*M*D^2 more parameters, applied to every pair
the head reads (target features and, inside a draft, its own predictions).

Partial alignment distillation (``partial_alignment`` = R in (0, 1)). EAGLE's head output g_t is trained both to
equal the target's next feature (smooth L1, "feature alignment") and to give the target's token distribution through
the LM head (the logits' confidence); FSPAD weakens that coupling so the two objectives stop conflicting. Here only
the first ceil(R*D) coordinates of g_t are aligned (:func:`partial_smooth_l1`); the token loss still reads all of g_t.
EAGLE-3 drops feature alignment altogether; with R > 0 its first draft step's output is partially aligned to the
target's next fused feature fc(a_{t+1}) (detached), weighted by ``align_weight``.

The paper's text was not available offline when this was written: the equations above are this implementation's
reading of its method (the abstract's "token embeddings sample features in a high-dimensional space" and "partial
alignment weakens the connection between features and logits"), not a transcription. Measured effects are in
docs/training.md.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.errors import SpecdraftError


class FeatureSampling(nn.Module):
    """f' = f + W_down(sigmoid(W_gate e) * W_up f) (module docstring); ``expansion`` = M."""

    def __init__(self, hidden: int, expansion: int) -> None:
        super().__init__()
        self.expansion = expansion
        self.up = nn.Linear(hidden, expansion * hidden, bias=False)
        self.gate = nn.Linear(hidden, expansion * hidden, bias=False)
        self.down = nn.Linear(expansion * hidden, hidden, bias=False)
        nn.init.normal_(self.up.weight, 0.0, 0.02)
        nn.init.normal_(self.gate.weight, 0.0, 0.02)
        nn.init.zeros_(self.down.weight)

    def forward(self, features: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """(..., D) features and (..., D) embeddings of the next tokens -> (..., D) sampled features."""
        lifted = self.up(features) * torch.sigmoid(self.gate(embeds.to(features.dtype)))  # (..., M*D)
        return features + self.down(lifted)


def aligned_width(hidden: int, fraction: float) -> int:
    """ceil(fraction * hidden) coordinates aligned, at least 1 (fraction 0 or 1: all of them)."""
    return hidden if fraction <= 0 or fraction >= 1 else max(1, math.ceil(fraction * hidden))


def partial_smooth_l1(predicted: torch.Tensor, truth: torch.Tensor, fraction: float) -> torch.Tensor:
    """Smooth L1 (beta 1) between the first ``aligned_width(D, fraction)`` coordinates of ``predicted`` and
    ``truth`` (n, D), mean over rows and those coordinates; fraction 0 or 1 aligns all D (EAGLE's L_reg)."""
    width = aligned_width(predicted.shape[-1], fraction)
    return F.smooth_l1_loss(predicted[..., :width], truth[..., :width])


def parse_fspad(options: dict[str, str], kind: str) -> dict:
    """``fspad_sampling`` (int M >= 0, 0 = off) and ``partial_alignment`` (R in [0, 1], 0 or 1 = EAGLE's full
    alignment for eagle; 0 = none for eagle3), checked."""
    try:
        sampling = int(options.get("fspad_sampling", "0"))
        fraction = float(options.get("partial_alignment", "0"))
    except ValueError:
        raise SpecdraftError(f"{kind} option fspad_sampling needs an integer and partial_alignment a number: "
                             f"{options}") from None
    if sampling < 0 or not 0 <= fraction <= 1:
        raise SpecdraftError(f"{kind} needs fspad_sampling >= 0 (0 = off) and 0 <= partial_alignment <= 1, got "
                             f"{sampling} and {fraction}")
    return {"fspad_sampling": sampling, "partial_alignment": fraction}


__all__ = ["FeatureSampling", "aligned_width", "parse_fspad", "partial_smooth_l1"]
