"""Periodic on-policy regeneration during ``finetune`` (``--regenerate-every N``): DistillSpec (Zhou et al. 2024,
arXiv 2310.08461) trains the drafter on its own current generations, scored by the target; here a pool of training
examples is answered afresh by the drafter being trained every N steps (:class:`Regenerator`), through the
distill-data machinery of :mod:`specdraft.training.data.distill_data` with ``policy="draft"``
(:mod:`specdraft.training.data.onpolicy`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specdraft.corpus import read_jsonl
from specdraft.errors import SpecdraftError
from specdraft.sampling import SamplingConfig
from specdraft.training.data import onpolicy
from specdraft.training.data.distill_data import DistillDataConfig, generate_distillation_data
from specdraft.training.objectives.losses import LOSSES
from specdraft.training.runs.checkpoint import CHECKPOINT_FILE, load_training_state
from specdraft.training.runs.folders import MANIFEST_FILE


def check_regeneration(config) -> None:
    """Validate ``finetune``'s on-policy settings (``only_mismatched``, ``regenerate_*``)."""
    if config.only_mismatched and not LOSSES[config.loss].needs_target:
        raise SpecdraftError(f"--only-mismatched compares q with p: use a distillation loss, not {config.loss}")
    for name, minimum in (("regenerate_every", 0), ("regenerate_prompts", 1), ("regenerate_max_new_tokens", 1)):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise SpecdraftError(f"{name} must be an integer >= {minimum}, got {value!r}")
    SamplingConfig(config.regenerate_temperature, 0, 1.0)  # validates the temperature
    if config.regenerate_every and config.fsdp:
        raise SpecdraftError("--regenerate-every needs the whole drafter on every process: drop --fsdp")


@dataclass(frozen=True)
class Regeneration:
    """What the pool reads of ``finetune``'s settings (``regenerate_*``, and where and how the run trains)."""

    every: int  # regenerate_every: refresh after every this many steps (0: no pool)
    prompts: int  # regenerate_prompts: the pool's size
    temperature: float  # regenerate_temperature: the drafter's sampling
    max_new_tokens: int  # regenerate_max_new_tokens
    target: str
    target_dtype: str
    batch_size: int
    seed: int
    steps: int
    out: str  # the run's working folder
    resume: bool


def regenerator(config: Regeneration, records: list[dict], need_topk: bool, target_model, tokenizer,
                keep: torch.Tensor | None = None) -> Regenerator | None:
    """``finetune``'s pool (appended to ``records``), refilled as of the checkpoint on resume; None when
    ``config.every`` is 0."""
    if not config.every:
        return None
    topk = len(records[0]["top_ids"][0]) if need_topk else 0
    pool = Regenerator(config, records, topk, target_model, tokenizer, keep)
    if config.resume:
        pool.restore(load_training_state(Path(config.out) / CHECKPOINT_FILE)["step"])
    return pool


class Regenerator:
    """A pool of ``regenerate_prompts`` training examples refreshed from the current drafter every
    ``regenerate_every`` steps (DistillSpec's on-policy data, made during training; GKD mixes it with the fixed
    data, here in the proportion pool size : data size).

    The pool is the tail of the training record list (the dataset reads that list, so its size never changes and
    the trainer's resumable data order holds). Before the first refresh it holds the data's own response to each
    pool prompt. Refresh k (after step s = k N) draws a seeded set of training prompts, has the drafter answer them
    (``distill-data --policy draft``, sampled at ``regenerate_temperature``) and the target score them, into
    ``<out>/onpolicy/step-<s>``: an ordinary, resumable distill-data folder. A resumed run refills the pool from the
    last folder at or before its checkpoint's step.
    """

    def __init__(self, config: Regeneration, records: list[dict], topk: int, target_model, tokenizer,
                 keep: torch.Tensor | None = None) -> None:
        self.config, self.records, self.topk, self.keep = config, records, topk, keep
        if any("messages" not in record for record in records):
            raise SpecdraftError("--regenerate-every needs the chat messages of each prompt in the data (records "
                                 "made by distill-data have them)")
        self.target_model, self.tokenizer = target_model, tokenizer
        first: dict[str, dict] = {}
        for record in records:
            first.setdefault(record.get("prompt_id", str(record["prompt_token_ids"])), record)
        self.prompts = list(first.items())
        self.size = min(config.prompts, len(self.prompts))
        self.start = len(records)
        records.extend(first[pid] for pid, _ in self._pool_prompts(0))

    def _pool_prompts(self, step: int) -> list[tuple[str, dict]]:
        generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + step)
        order = torch.randperm(len(self.prompts), generator=generator)[: self.size].tolist()
        return [self.prompts[i] for i in order]

    def folder(self, step: int) -> Path:
        return Path(self.config.out) / "onpolicy" / f"step-{step:06d}"

    def restore(self, step: int) -> None:
        """Refill the pool as it was after ``step`` (a resumed run), from the folder of the last refresh."""
        every = self.config.every
        if every and step >= every:
            self._fill(self.folder(step // every * every))

    def __call__(self, step: int, drafter) -> None:
        """The trainer's after-step hook: refresh the pool when ``step`` is a multiple of ``regenerate_every``."""
        if not self.config.every or step % self.config.every or step == self.config.steps:
            return  # nothing after the last step: no training would read it
        c = self.config
        data = DistillDataConfig(
            target=c.target, out=str(self.folder(step)), prompts=f"pool:{step}", responses_per_prompt=1,
            max_new_tokens=c.max_new_tokens, temperature=c.temperature,
            top_logprobs=self.topk, batch_size=c.batch_size, dtype=c.target_dtype, seed=c.seed + step,
            policy="draft", draft=f"{c.out} at step {step}")
        prompts = [(pid, record["messages"]) for pid, record in self._pool_prompts(step)]
        was_training = drafter.training
        drafter.eval()
        hook = None if self.keep is None else onpolicy.restrict_to(drafter, self.keep)  # answers as it drafts
        try:
            with torch.random.fork_rng(devices=[]):  # generation seeds the global generator; training must not see it
                generate_distillation_data(data, progress=False, prompts=prompts,
                                           models=(self.target_model, self.tokenizer, drafter))
        finally:
            drafter.train(was_training)
            if hook is not None:
                hook.remove()
        self._fill(self.folder(step))

    def _fill(self, folder: Path) -> None:
        try:
            manifest = json.loads((folder / MANIFEST_FILE).read_text())
        except (OSError, ValueError):
            raise SpecdraftError(f"{folder} is missing or damaged: the pool it held cannot be restored; restart the "
                                 "run without --resume") from None
        if not manifest.get("complete"):
            raise SpecdraftError(f"{folder} is incomplete: the run stopped while regenerating; resume it")
        fresh = [record for name in sorted(manifest["shards"]) for record in read_jsonl(folder / name)]
        if len(fresh) != self.size:
            raise SpecdraftError(f"{folder} holds {len(fresh)} records, the pool has {self.size} slots")
        self.records[self.start : self.start + self.size] = fresh
