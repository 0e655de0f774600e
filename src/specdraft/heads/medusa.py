"""Medusa heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads", arXiv 2401.10774), Medusa-1: the target stays frozen and only the heads are trained.

Head k (k = 1..K) reads the target's final-normed hidden state h_t at position t (the LM head's input; the LM
head itself predicts token t+1) and predicts token t+k+1:

    p_t^(k) = softmax(W_2^(k) (SiLU(W_1^(k) h_t + b_1^(k)) + h_t))          (paper, Sec. 2.1.1)

W_1 and b_1 start at zero, so a fresh head is the identity followed by its projection. Medusa gives every head
its own projection W_2^(k) (V x D) initialised from the target's LM head; with ``share_lm_head`` (our default,
for CPU-sized training) the heads instead reuse the frozen LM head, so a head has only D*D + D parameters (a
576 x 49152 projection would be 28M parameters a head). A fresh shared head's logits then equal the LM head's
logits of the same hidden state.

Loss (Medusa-1, Sec. 2.2.1): sum_k λ_k CE(p_t^(k), y_{t+k+1}) over response positions, λ_k = decay^(k-1) with
decay = 0.8 as in Medusa's training code (``medusa_decay_coefficient ** i`` over 0-based heads; the same as 0.8^k
up to a constant factor).

Self-distillation (option ``distill=1``; Medusa paper Sec. 2.3.2): the hard label y_{t+k+1} is replaced by the
frozen target's own distribution over that token, softmax(W_lm h_{t+k}), computed from the same teacher features,
so the loss is sum_k λ_k CE(softmax(W_lm h_{t+k}), p_t^(k)) (a KL divergence up to the target's entropy). Hard
labels sampled at temperature 1 are a noisy estimate of that distribution; with little data the soft one is the
better signal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.errors import SpecdraftError

DEFAULT_DECAY = 0.8


class MedusaHeads(nn.Module):
    """K Medusa heads over hidden size D and vocabulary V (see the module docstring)."""

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, share_lm_head: bool = True) -> None:
        super().__init__()
        if min(hidden_size, vocab_size, num_heads) < 1:
            raise SpecdraftError(f"Medusa heads need positive sizes, got hidden_size={hidden_size}, "
                                 f"vocab_size={vocab_size}, num_heads={num_heads}")
        self.hidden_size, self.vocab_size, self.num_heads = hidden_size, vocab_size, num_heads
        self.share_lm_head, self.decay = share_lm_head, DEFAULT_DECAY  # decay: the loss's λ_k = decay^(k-1)
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        self.proj = None if share_lm_head else nn.ModuleList(
            nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads))
        for block in self.blocks:  # a fresh residual block is the identity
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The residual blocks: (..., D) -> (K, ..., D)."""
        return torch.stack([F.silu(block(hidden)) + hidden for block in self.blocks])

    def forward(self, hidden: torch.Tensor, lm_head: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (K, ..., V) of every head from hidden states (..., D); ``lm_head`` (V, D) is the target's LM head
        weight, needed when the heads share it."""
        feats = self.features(hidden)  # (K, ..., D)
        if self.proj is None:
            if lm_head is None:
                raise SpecdraftError("these Medusa heads share the target's LM head: pass its weight")
            return feats @ lm_head.to(feats.dtype).T  # (K, ..., V)
        return torch.stack([proj(feats[k]) for k, proj in enumerate(self.proj)])  # (K, ..., V)

    def init_from_lm_head(self, lm_head: torch.Tensor) -> None:
        """Copy the target's LM head (V, D) into every head's own projection (Medusa's initialisation)."""
        if lm_head.shape != (self.vocab_size, self.hidden_size):
            raise SpecdraftError(f"LM head of shape {tuple(lm_head.shape)} does not fit heads of vocabulary "
                                 f"{self.vocab_size} and hidden size {self.hidden_size}")
        if self.proj is not None:
            with torch.no_grad():
                for proj in self.proj:
                    proj.weight.copy_(lm_head)


def medusa_loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, decay: float = DEFAULT_DECAY,
                teacher: torch.Tensor | None = None) -> tuple[torch.Tensor, list[tuple[float, int]], int]:
    """The Medusa-1 loss and per-head top-1 accuracy (against the labels), on right-padded batches.

    Args:
        logits: (K, B, T, V) head logits at every position t.
        labels: (B, T) label t is token t+1 (as :func:`~specdraft.training.data.batches.collate_distill` makes them),
            so head k's label at t is ``labels[:, t + k]``.
        mask: (B, T) True where the label is a response token.
        teacher: (B, T, V) the target's probabilities of label t (self-distillation's soft labels), or None.
    Returns:
        (sum_k decay^(k-1) * mean CE of head k, [(correct top-1, counted) per head], positions counted by head 1).
    """
    total, accuracy, width = logits.new_zeros((), dtype=torch.float32), [], labels.shape[1]
    for k in range(1, logits.shape[0] + 1):
        keep = mask[:, k:]  # (B, T - k): head k at t is scored when label t+k is a response token
        if width <= k or not bool(keep.any()):
            accuracy.append((0.0, 0))
            continue
        head = logits[k - 1, :, : width - k][keep].float()  # (n, V)
        target = labels[:, k:][keep]  # (n,)
        soft = None if teacher is None else teacher[:, k:][keep].float()  # (n, V)
        total = total + decay ** (k - 1) * F.cross_entropy(head, target if soft is None else soft)
        accuracy.append((float((head.argmax(-1) == target).sum()), int(target.shape[0])))
    return total, accuracy, accuracy[0][1]


# --- the spec: sizes and loss settings, as stored in heads.json --------------------------------------------------


def medusa_spec(target_config, config, options: dict[str, str]) -> dict:
    unknown = sorted(set(options) - {"decay", "distill"})
    if unknown:
        raise SpecdraftError(f"unknown medusa option {', '.join(unknown)}; medusa takes: decay, distill")
    try:
        decay = float(options.get("decay", DEFAULT_DECAY))
    except ValueError:
        raise SpecdraftError(f"medusa option decay must be a number, got {options['decay']!r}") from None
    if not 0 < decay <= 1:
        raise SpecdraftError(f"medusa option decay must be in (0, 1], got {decay}")
    distill = options.get("distill", "0")
    if distill not in ("0", "1"):
        raise SpecdraftError(f"medusa option distill must be 0 (hard labels) or 1 (soft labels), got {distill!r}")
    return {"hidden_size": int(target_config.hidden_size), "vocab_size": int(target_config.vocab_size),
            "num_heads": config.num_heads, "share_lm_head": bool(config.share_lm_head), "decay": decay,
            "distill": distill == "1"}


def build_medusa(spec: dict) -> MedusaHeads:
    """Fresh heads from a spec (``heads.json``'s ``spec``)."""
    try:
        heads = MedusaHeads(int(spec["hidden_size"]), int(spec["vocab_size"]), int(spec["num_heads"]),
                            bool(spec.get("share_lm_head", True)))
        heads.decay = float(spec.get("decay", DEFAULT_DECAY))  # loss settings, kept with the heads
        heads.distill = bool(spec.get("distill", False))
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecdraftError(f"bad Medusa heads spec {spec!r}: {exc}") from None
    return heads
