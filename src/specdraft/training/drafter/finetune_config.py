"""The settings of ``specdraft finetune`` (stage 2 of Goel et al. 2024, arXiv 2403.00858), checked when built.
The stage (:mod:`specdraft.training.drafter.finetune`) hands its loss and its evaluation
(:mod:`specdraft.training.drafter.distillation`) only what they read (:meth:`FinetuneConfig.objective`,
:meth:`FinetuneConfig.evaluation`).

The settings of the losses are not listed here: every option of a registered loss
(:data:`specdraft.training.objectives.losses.LOSSES`) becomes a field after ``loss`` (:func:`with_loss_options`),
so a new loss brings its flags (``--alpha``) and recipe keys with it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from specdraft.errors import SpecdraftError
from specdraft.training.drafter import regenerate
from specdraft.training.drafter.distillation import Evaluation, Objective
from specdraft.training.objectives.losses import LOSSES, all_options, users
from specdraft.training.runs.checkpoint import EXPORT_DTYPES
from specdraft.training.runs.trainer import TrainerConfig, check_choices, check_ints


def with_loss_options(cls: type) -> type:
    """Give the settings class ``cls`` (before ``@dataclass``) one field per option of the registered losses,
    right after its ``loss`` field, with the option's default and help (which names the losses that take it)."""
    own = inspect.get_annotations(cls)
    annotations = {}
    for name, kind in own.items():
        annotations[name] = kind
        if name != "loss":
            continue
        for option in all_options().values():
            if option.name in own:
                raise TypeError(f"{cls.__name__}.{option.name} is a field already: rename the loss option")
            annotations[option.name] = type(option.default).__name__  # "float" or "str", as the CLI maps them
            setattr(cls, option.name, field(default=option.default,
                                            metadata={"help": f"{', '.join(users(option.name))}: {option.help}"}))
    cls.__annotations__ = annotations
    return cls


@dataclass(frozen=True, kw_only=True)
@with_loss_options
class FinetuneConfig(TrainerConfig):
    """Settings of ``specdraft finetune``."""

    drafter: str = field(metadata={"help": "pretrained drafter checkpoint folder"})
    target: str = field(metadata={"help": "target model (built-in name, folder or cached hub id)"})
    data: str = field(metadata={"help": "distill-data output folder, or several, comma-separated (their records are "
                                        "pooled)"})
    loss: str = field(default="fkl", metadata={"help": "loss: " + ", ".join(
        f"{name} ({loss.summary})" for name, loss in LOSSES.items())})
    lr: float = field(default=3e-4, metadata={"help": "peak learning rate"})
    use_stored_topk: bool = field(default=False, metadata={"help": "p from the stored top-k (an approximation)"})
    allow_incomplete: bool = field(default=False, metadata={"help": "train on an unfinished distill-data folder"})
    max_seq_len: int = field(default=512, metadata={"help": "prompt + response tokens kept per example"})
    heldout_every: int = field(default=20, metadata={"help": "hold out every N-th prompt for evaluation"})
    eval_prompts: int = field(default=8, metadata={"help": "held-out prompts decoded for block efficiency"})
    eval_max_new_tokens: int = field(default=64, metadata={"help": "tokens generated per evaluation prompt"})
    eval_num_draft_tokens: str = field(default="3,5", metadata={"help": "γ values evaluated, comma-separated"})
    target_dtype: str = field(default="float32", metadata={"help": "target weights: float32 or bfloat16"})
    export_dtype: str = field(default="float32", metadata={"help": "exported weights: float32 or bfloat16"})
    freeze_embeddings: bool = field(default=False, metadata={"help": "keep the (tied) token embeddings fixed"})
    draft_vocab: int = field(default=0, metadata={
        "help": "train q over the N most frequent response tokens only, as drafted with the draft_vocab=N option "
                "(FR-Spec; 0 = the whole vocabulary)"})
    draft_vocab_from: str = field(default="", metadata={
        "help": "rank the draft vocabulary as this drafter does (its stored token ranking) instead of by the "
                "training responses: runs on different data then train the same N tokens"})
    share_embeddings: bool = field(default=False, metadata={
        "help": "export without the embeddings, which must be the target's: the drafter then loads them from the "
                "target (needs --freeze-embeddings)"})
    only_mismatched: bool = field(default=False, metadata={
        "help": "train only where argmax q differs from argmax p (OSD: the drafts greedy verification rejects)"})
    regenerate_every: int = field(default=0, metadata={
        "help": "every N steps the current drafter answers a pool of training prompts (on-policy; 0 = never)"})
    regenerate_prompts: int = field(default=256, metadata={"help": "prompts in the regenerated pool"})
    regenerate_temperature: float = field(default=1.0, metadata={"help": "drafter sampling when regenerating"})
    regenerate_max_new_tokens: int = field(default=128, metadata={"help": "response cap when regenerating"})
    eval_data: str = field(default="", metadata={
        "help": "evaluate on this distill-data folder instead of the held-out split (e.g. the target's greedy answers "
                "to Spec-Bench questions); on greedy target answers also the exact greedy τ at each γ"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.share_embeddings and not self.freeze_embeddings:
            raise SpecdraftError("--share-embeddings needs --freeze-embeddings (the exported drafter uses the "
                                 "target's table, so training must not change its copy)")
        check_choices(self, ("loss",), LOSSES)
        for name, option in all_options().items():  # every loss's settings, whichever loss runs
            option.parse(getattr(self, name), "finetune")
        check_ints(self, ("max_seq_len", "eval_max_new_tokens"), 1)
        check_ints(self, ("eval_prompts", "draft_vocab"), 0)
        check_ints(self, ("heldout_every",), 2)
        check_choices(self, ("target_dtype", "export_dtype"), EXPORT_DTYPES)
        regenerate.check_regeneration(self)
        self.num_draft_tokens()

    def num_draft_tokens(self) -> tuple[int, ...]:
        """The γ values of ``eval_num_draft_tokens``."""
        try:
            values = tuple(int(v) for v in self.eval_num_draft_tokens.split(",") if v.strip())
        except ValueError:
            values = ()
        if not values or min(values) < 1:
            raise SpecdraftError(f"eval_num_draft_tokens must be comma-separated integers >= 1, "
                                 f"got {self.eval_num_draft_tokens!r}")
        return values

    def loss_settings(self) -> dict:
        """The settings of the chosen loss, by option name."""
        loss = LOSSES[self.loss]
        return loss.settings({option.name: getattr(self, option.name) for option in loss.options}, "finetune")

    def objective(self) -> Objective:
        """What the loss reads."""
        return Objective(self.loss, self.loss_settings(), self.use_stored_topk, self.only_mismatched)

    def regeneration(self) -> regenerate.Regeneration:
        """What the on-policy pool reads."""
        return regenerate.Regeneration(self.regenerate_every, self.regenerate_prompts, self.regenerate_temperature,
                                       self.regenerate_max_new_tokens, self.target, self.target_dtype,
                                       self.batch_size, self.seed, self.steps, self.out, self.resume)

    def evaluation(self) -> Evaluation:
        """What the evaluation reads."""
        return Evaluation(self.num_draft_tokens(), self.eval_prompts, self.eval_max_new_tokens, self.max_seq_len,
                          self.batch_size, bool(self.bf16), self.eval_data)

