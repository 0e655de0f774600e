"""Settings of ``specdraft serve --online-distill DIR`` (:mod:`specdraft.serve.online`), validated on
construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdraft.errors import SpecdraftError
from specdraft.training.objectives.losses import get_loss, loss_names

ONLINE_LOSSES = loss_names(online=True)  # the registered losses that train against p (the stored top-k)


@dataclass(frozen=True)
class OnlineDistillConfig:
    """Settings of ``specdraft serve --online-distill DIR``."""

    folder: str = field(metadata={"help": "replay buffer, accepted drafter and history"})
    loss: str = field(default="fkl", metadata={"help": f"one of {', '.join(ONLINE_LOSSES)}"})
    loss_options: tuple[tuple[str, str], ...] = field(default=(), metadata={
        "help": "settings of the loss, (NAME, VALUE) pairs (e.g. ('alpha', '0.2') for skl)"})
    every_tokens: int = field(default=2048, metadata={"help": "a training round after this many served tokens"})
    steps: int = field(default=32, metadata={"help": "optimizer steps per round"})
    batch_size: int = field(default=4, metadata={"help": "records per optimizer step"})
    lr: float = field(default=1e-4, metadata={"help": "AdamW learning rate"})
    max_records: int = field(default=512, metadata={"help": "records the buffer keeps (the oldest are dropped)"})
    heldout_every: int = field(default=5, metadata={"help": "every this many-th record is held back"})
    heldout_records: int = field(default=32, metadata={"help": "latest held-back records candidates are scored on"})
    top_k: int = field(default=32, metadata={"help": "top-k log-probabilities of p stored per position"})
    max_seq_len: int = field(default=512, metadata={"help": "training window (prompt end and response)"})
    seed: int = field(default=0, metadata={"help": "shuffling seed (plus the round number)"})
    nice: int = field(default=19, metadata={"help": "CPU niceness of the training thread (0 = as the server)"})

    def __post_init__(self) -> None:
        self.loss_settings()  # the loss and its settings, checked
        for name in ("every_tokens", "steps", "batch_size", "max_records", "heldout_records", "top_k", "max_seq_len"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise SpecdraftError(f"online {name} must be an integer >= 1, got {getattr(self, name)}")
        if not 0 <= self.nice <= 19:
            raise SpecdraftError(f"online nice must be in 0 .. 19, got {self.nice}")
        if self.heldout_every < 2:
            raise SpecdraftError(f"online heldout_every must be >= 2, got {self.heldout_every}")
        if not self.lr > 0:
            raise SpecdraftError(f"online lr must be > 0, got {self.lr}")

    def loss_settings(self) -> dict:
        """Every setting of the loss (those not given at their defaults), checked."""
        loss = get_loss(self.loss, online=True, where="online loss")
        return loss.settings(dict(self.loss_options), f"online loss {self.loss}")
