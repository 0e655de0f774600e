"""Stage 2 of draft training (Goel et al. 2024, arXiv 2403.00858): align a pretrained drafter with the
target by knowledge distillation on the target's own responses (made by ``specdraft distill-data``).

Each example is the prompt followed by the target's response, right-padded in a batch. The loss counts only the
positions whose label is a response token. The target distribution p is computed on the fly under
``torch.no_grad()`` by the transformers target, or, with ``use_stored_topk``, rebuilt from the top-k
log-probabilities stored in the data: the stored k tokens keep their log-probabilities and the remaining mass is
spread uniformly over the other tokens. That is an approximation of p, labelled as such in the model card.

Draft vocabulary (``draft_vocab`` = N > 0): the drafter is trained to draft only the N tokens most frequent in the
training responses (FR-Spec, Zhao et al. 2025, arXiv 2502.14856; :mod:`specdraft.draft_vocab`), which is how it is
then run with ``--drafter-option draft_vocab=N``. Its logits are computed for those N rows of the LM head only (for
a small drafter with a 49k-token vocabulary the head is most of the training step) and p is restricted to the same
N tokens and renormalised, so q is trained over exactly the support it drafts from.

Evaluation (every ``eval_every`` steps and at the end) reports the held-out loss, TVD (1 − TVD is the expected
acceptance rate) and forward KL against the real target, and the block efficiency τ of greedy speculative decoding
with the real decoder (:func:`specdraft.decoding.generate`) on prompts whose responses were held out.

On-policy options: OSD's ``only_mismatched`` (:mod:`specdraft.training.onpolicy`), DistillSpec's ``regenerate_every``
(:mod:`specdraft.training.regenerate`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdraft.draft_vocab import DraftVocab, load_token_ranking, rank_tokens
from specdraft.errors import SpecdraftError
from specdraft.training import onpolicy, regenerate
from specdraft.training.checkpoint import export_hf, hardware
from specdraft.training.losses import LOSSES, NORMALIZATIONS, WEIGHTINGS, distillation_loss, forward_kl, tvd
from specdraft.training.pretrain import EXPORT_DTYPES, export_path
from specdraft.training.runs import owns_out
from specdraft.training.stages import begin_stage, data_inputs, end_stage
from specdraft.training.trainer import (
    TrainerConfig,
    TrainResult,
    check_choices,
    check_ints,
    init_distributed,
    train,
)


@dataclass(frozen=True, kw_only=True)
class FinetuneConfig(TrainerConfig):
    """Settings of ``specdraft finetune``."""

    drafter: str = field(metadata={"help": "pretrained drafter checkpoint folder"})
    target: str = field(metadata={"help": "target model (built-in name, folder or cached hub id)"})
    data: str = field(metadata={"help": "distill-data output folder, or several, comma-separated (their records are "
                                        "pooled)"})
    loss: str = field(default="fkl", metadata={"help": f"loss: {', '.join(LOSSES)}"})
    beta: float = field(default=0.5, metadata={"help": "jsd: weight of p in the mixture"})
    weighting: str = field(default="q", metadata={"help": f"tvdpp: {' or '.join(WEIGHTINGS)}"})
    normalization: str = field(default="batch", metadata={"help": f"tvdpp: {', '.join(NORMALIZATIONS)}"})
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
        if not 0.0 <= self.beta <= 1.0:
            raise SpecdraftError(f"beta must be in [0, 1], got {self.beta}")
        check_choices(self, ("loss",), LOSSES)
        check_choices(self, ("weighting",), WEIGHTINGS)
        check_choices(self, ("normalization",), NORMALIZATIONS)
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

    def loss_options(self, generator: torch.Generator | None) -> dict:
        """Keyword options of the chosen loss."""
        if self.loss == "jsd":
            return {"beta": self.beta}
        if self.loss == "tvdpp":
            extra = {"generator": generator} if self.weighting == "sample" else {}
            return {"weighting": self.weighting, "normalization": self.normalization} | extra
        return {}


# --- data ------------------------------------------------------------------------------------------------------------


def data_folders(spec: str) -> list[str]:
    """The folders of ``--data``: one, or several separated by commas (each named once)."""
    folders = list(dict.fromkeys(part.strip() for part in spec.split(",") if part.strip()))
    if not folders:
        raise SpecdraftError(f"--data names no folder: {spec!r}")
    return folders


def load_distill_records(folder: str | Path, allow_incomplete: bool = False, need_topk: bool = False) -> list[dict]:
    """The records of a distill-data folder, checked: every shard's record count and checksum against the manifest
    (:func:`specdraft.training.runs.verify_shards`), then every record; an unfinished folder is refused unless
    ``allow_incomplete``."""
    from specdraft.training.data import read_jsonl
    from specdraft.training.runs import read_manifest, verify_shards

    folder = Path(folder)
    manifest = read_manifest(folder)
    shards = sorted(manifest["shards"])
    if not manifest.get("complete") and not allow_incomplete:
        raise SpecdraftError(f"{folder} is incomplete ({len(shards)} of {manifest.get('num_shards')} shards): "
                             "finish distill-data or pass --allow-incomplete")
    verify_shards(folder, manifest, shards)
    records = [record for name in shards for record in read_jsonl(folder / name)]
    for number, record in enumerate(records):
        _check_record(record, f"{folder} record {number}", need_topk)
    if not records:
        raise SpecdraftError(f"{folder} holds no records")
    return records


def _check_record(record: dict, where: str, need_topk: bool) -> None:
    for key in ("prompt_token_ids", "response_token_ids"):
        ids = record.get(key)
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise SpecdraftError(f"{where}: {key!r} must be a non-empty list of token ids")
    if need_topk and ("top_ids" not in record or "top_logprobs" not in record):
        raise SpecdraftError(f"{where}: no stored top-k ('top_ids', 'top_logprobs'); make the data with "
                             "--top-logprobs K or drop --use-stored-topk")


def split_by_prompt(records: list[dict], every: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out) records: every ``every``-th distinct prompt, with all its responses, is held out."""
    from specdraft.training.data import holdout_every

    ids = list(dict.fromkeys(r.get("prompt_id", json.dumps(r["prompt_token_ids"])) for r in records))
    if len(ids) < every:
        raise SpecdraftError(f"only {len(ids)} distinct prompts; heldout_every={every} would hold none out")
    heldout = set(holdout_every(ids, every)[1])
    train = [r for r in records if r.get("prompt_id", json.dumps(r["prompt_token_ids"])) not in heldout]
    return train, [r for r in records if r.get("prompt_id", json.dumps(r["prompt_token_ids"])) in heldout]


class DistillDataset(torch.utils.data.Dataset):
    """Prompt + response token sequences of at most ``max_seq_len + 1`` tokens, with the prompt length.

    A sequence that is too long loses the start of its prompt first (down to half the window), then the end of its
    response: a long prompt (an article to summarise) keeps its end and its whole response, which are what the
    drafter is trained on, instead of leaving no response token at all.
    """

    def __init__(self, records: list[dict], max_seq_len: int, topk: bool = False) -> None:
        self.records, self.max_len, self.topk = records, max_seq_len + 1, topk

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict:
        record = self.records[index]
        prompt, response = record["prompt_token_ids"], record["response_token_ids"]
        excess = len(prompt) + len(response) - self.max_len
        drop = min(max(excess, 0), max(len(prompt) - self.max_len // 2, 0))  # prompt tokens cut from the left
        ids = (prompt[drop:] + response)[: self.max_len]
        item = {"ids": torch.tensor(ids), "prompt_len": len(prompt) - drop}
        if self.topk:
            item["top_ids"] = torch.tensor(record["top_ids"])  # (R, k): distribution of response token r
            item["top_logprobs"] = torch.tensor(record["top_logprobs"], dtype=torch.float32)  # (R, k)
        return item


def collate_distill(items: list[dict], pad_id: int) -> dict:
    """Right-padded batch: input_ids, labels, attention_mask, mask (True where the label is a response token),
    and with stored top-k, ``top_ids`` / ``top_logprobs`` (B, T, k) aligned with the labels."""
    width = max(item["ids"].shape[0] for item in items) - 1  # T
    batch = {"input_ids": torch.full((len(items), width), pad_id), "labels": torch.full((len(items), width), pad_id),
             "attention_mask": torch.zeros(len(items), width, dtype=torch.long),
             "mask": torch.zeros(len(items), width, dtype=torch.bool)}
    topk = "top_ids" in items[0]
    if topk:
        k = items[0]["top_ids"].shape[-1]
        batch["top_ids"] = torch.zeros(len(items), width, k, dtype=torch.long)
        batch["top_logprobs"] = torch.zeros(len(items), width, k)
    for row, item in enumerate(items):
        ids, start = item["ids"], item["prompt_len"] - 1  # label j is ids[j + 1]: a response token from j = P - 1
        length = ids.shape[0] - 1
        batch["input_ids"][row, :length], batch["labels"][row, :length] = ids[:-1], ids[1:]
        batch["attention_mask"][row, :length] = 1
        batch["mask"][row, start:length] = True
        if topk and length > start:
            batch["top_ids"][row, start:length] = item["top_ids"][: length - start]
            batch["top_logprobs"][row, start:length] = item["top_logprobs"][: length - start]
    return batch


def dense_from_topk(top_ids: torch.Tensor, top_logprobs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Approximate log p (n, V) from top-k (n, k): stored entries kept, leftover mass spread evenly elsewhere."""
    rest = (1.0 - top_logprobs.exp().sum(-1, keepdim=True)).clamp_min(1e-9)  # (n, 1)
    fill = rest.log() - math.log(max(vocab_size - top_ids.shape[-1], 1))  # (n, 1)
    dense = fill.expand(-1, vocab_size).clone()  # (n, V)
    return dense.scatter_(-1, top_ids, top_logprobs)


def subset_from_topk(top_ids: torch.Tensor, top_logprobs: torch.Tensor, keep: torch.Tensor,
                     vocab_size: int) -> torch.Tensor:
    """``dense_from_topk(top_ids, top_logprobs, vocab_size)[:, keep]`` (n, N) without building the (n, V) table.

    Args:
        top_ids, top_logprobs: (n, k) the stored top-k of p.
        keep: (N,) distinct token ids (the draft vocabulary).
    """
    column = _columns(keep, vocab_size, missing=keep.shape[0])  # (V,): N = not kept
    rest = (1.0 - top_logprobs.exp().sum(-1, keepdim=True)).clamp_min(1e-9)  # (n, 1)
    fill = rest.log() - math.log(max(vocab_size - top_ids.shape[-1], 1))  # (n, 1)
    out = fill.expand(-1, keep.shape[0] + 1).clone()  # (n, N + 1): the extra column takes the ids not kept
    return out.scatter_(-1, column[top_ids], top_logprobs)[:, :-1]


def _columns(keep: torch.Tensor, vocab_size: int, missing: int) -> torch.Tensor:
    """(V,) the column of each token id in ``keep`` (N,), ``missing`` for ids not kept."""
    column = torch.full((vocab_size,), missing, dtype=torch.long, device=keep.device)
    column[keep] = torch.arange(keep.shape[0], device=keep.device)
    return column


def subset_labels(labels: torch.Tensor, keep: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels (n,) as columns of ``keep`` (n,), and the mask (n,) of those inside it (the others cannot be drafted)."""
    columns = _columns(keep, vocab_size, missing=-1)[labels]  # (n,)
    return columns.clamp_min(0), columns >= 0


# --- loss and evaluation ---------------------------------------------------------------------------------------------


def make_kd_loss(config: FinetuneConfig, target_model, keep: torch.Tensor | None = None):
    """loss_fn(model, batch, generator) for the trainer: the chosen loss on response positions only; with ``keep``
    (N,) on the draft vocabulary (q and p both over those N tokens, p renormalised by the loss's softmax)."""
    vocab_size = target_model.config.vocab_size

    def kd_loss(model, batch: dict, generator: torch.Generator) -> tuple[torch.Tensor, int]:
        mask = batch["mask"]  # (B, T)
        draft = response_logits(model, batch, keep)  # (n, N) or (n, V)
        target = None
        if config.loss != "ce" and config.use_stored_topk:
            top_ids, top_logprobs = batch["top_ids"][mask], batch["top_logprobs"][mask]  # (n, k)
            target = (dense_from_topk(top_ids, top_logprobs, vocab_size) if keep is None
                      else subset_from_topk(top_ids, top_logprobs, keep, vocab_size))
        elif config.loss != "ce":
            target = target_logits(target_model, batch)[mask]  # (n, V)
            target = target if keep is None else target[:, keep]  # (n, N)
        labels = batch["labels"][mask]  # (n,)
        if config.only_mismatched:  # OSD: only the positions whose draft greedy verification would reject
            draft, target, labels = onpolicy.mismatched(draft, target, labels)
            if draft.shape[0] == 0:
                return draft.sum(), 0
        return _kd_value(config, draft, target, labels, keep, vocab_size, generator), draft.shape[0]

    return kd_loss


def _kd_value(config: FinetuneConfig, draft: torch.Tensor, target: torch.Tensor | None, labels: torch.Tensor,
              keep: torch.Tensor | None, vocab_size: int, generator: torch.Generator | None) -> torch.Tensor:
    """The configured loss of ``draft`` (n, N or V) against ``target`` (same columns) or ``labels`` (n,); with a
    draft vocabulary ``keep``, "ce" counts only the labels inside it (the others cannot be drafted)."""
    counted = None
    if config.loss == "ce" and keep is not None:
        labels, counted = subset_labels(labels, keep, vocab_size)
    return distillation_loss(config.loss, draft, target, labels, counted, **config.loss_options(generator))


def response_logits(model, batch: dict, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The drafter's logits (n, V) at the response positions of a batch (``batch["mask"]``); with ``keep`` (N,),
    only those columns (n, N).

    For a Llama the LM head runs on those positions only, and on the ``keep`` rows only: it is most of a small
    drafter's cost, and prompt positions carry no loss. Other architectures (whose heads may scale or cap logits)
    and wrapped or sharded models (DDP, FSDP: their hooks run on the whole module's forward) run their full forward.
    """
    from torch.distributed.fsdp import FSDPModule

    mask = batch["mask"]  # (B, T)
    plain = not isinstance(model, FSDPModule) and getattr(getattr(model, "config", None), "model_type", None)
    if plain == "llama" and hasattr(model, "lm_head") and getattr(model.lm_head, "bias", None) is None:
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             use_cache=False).last_hidden_state  # (B, T, D)
        weight = model.lm_head.weight if keep is None else model.lm_head.weight[keep]  # (V or N, D)
        return torch.nn.functional.linear(hidden[mask], weight)  # (n, V or N)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    return logits[mask] if keep is None else logits[mask][:, keep]


@torch.no_grad()
def target_logits(target_model, batch: dict) -> torch.Tensor:
    """The target's logits (B, T, V) for a right-padded batch, without gradient."""
    return target_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits


def heldout_metrics(model, target_model, batches: list[dict], config: FinetuneConfig,
                    keep: torch.Tensor | None = None) -> dict[str, float]:
    """On held-out response positions, against the real target (never the stored top-k): the training loss, TVD
    (1 − TVD is the expected acceptance rate) and forward KL, each a mean over positions.

    With a draft vocabulary ``keep`` (N,), TVD is the exact one of the drafter as run (q = 0 outside ``keep``,
    against the full p), while the loss and forward KL compare q with p restricted to ``keep`` and renormalised
    (the training objective; the full KL would be infinite), and ``heldout_coverage`` is p's mass inside ``keep``.
    """
    device = next(model.parameters()).device
    vocab_size = target_model.config.vocab_size
    vocab = None if keep is None else DraftVocab(torch.empty(vocab_size, 0, device=device), keep)
    sums, count = {"heldout_loss": 0.0, "heldout_tvd": 0.0, "heldout_fkl": 0.0}, 0
    if keep is not None:
        sums["heldout_coverage"] = 0.0
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        mask = batch["mask"]  # (B, T)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.bf16):
            draft = response_logits(model, batch, keep)  # (n, N) or (n, V)
            target = target_logits(target_model, batch)[mask]  # (n, V)
        n = int(mask.sum())
        kept = target if keep is None else target[:, keep]  # (n, N or V)
        generator = torch.Generator(device=device).manual_seed(0)
        loss = _kd_value(config, draft, kept, batch["labels"][mask], keep, vocab_size, generator)
        if keep is not None:
            sums["heldout_coverage"] += float(torch.softmax(target.float(), -1)[:, keep].sum(-1).sum())
        sums["heldout_loss"] += float(loss) * n
        as_run = draft if vocab is None else vocab.expand(draft)  # (n, V): q = 0 outside keep, as drafted
        sums["heldout_tvd"] += float(tvd(as_run, target)) * n
        sums["heldout_fkl"] += float(forward_kl(draft, kept)) * n
        count += n
    return {k: v / max(count, 1) for k, v in sums.items()}


def block_efficiency(target, drafter_model, prompts: Sequence[Sequence[int]], num_draft_tokens: int,
                     max_new_tokens: int, eos_token_ids: tuple[int, ...] = (),
                     keep: torch.Tensor | None = None) -> float:
    """τ = new tokens / target forwards of greedy speculative decoding over ``prompts``, pooled.

    Args:
        target: a :class:`~specdraft.models.base.CausalLM`.
        drafter_model: a transformers causal LM (copied to the native fp32 implementation when it is a Llama).
        keep: (N,) the draft vocabulary, or None for the whole vocabulary.
    """
    from specdraft.decoding import GenerationConfig, generate
    from specdraft.drafters.draft_model import DraftModelDrafter
    from specdraft.models.hf import HFCausalLM
    from specdraft.models.native_llama import NativeLlama, supports

    if supports(drafter_model.config):
        draft = NativeLlama.from_hf(drafter_model, torch.float32)  # a CPU fp32 copy
    else:
        draft = HFCausalLM(drafter_model)
    config = GenerationConfig(max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens, speculation="fixed",
                              eos_token_ids=tuple(eos_token_ids))
    keep = None if keep is None else keep.cpu()
    new_tokens, forwards = 0, 0
    for prompt in prompts:
        stats = generate(target, list(prompt), DraftModelDrafter(draft, keep=keep), config).stats
        new_tokens, forwards = new_tokens + stats.new_tokens, forwards + stats.target_forward_calls
    return new_tokens / max(forwards, 1)


def draft_logits_fn(model, keep: torch.Tensor | None, bf16: bool):
    """batch -> the drafter's logits at the batch's response positions (:func:`response_logits`), the batch moved to
    the drafter's device and run under bf16 autocast when ``bf16`` (for :mod:`specdraft.training.exact_tau`)."""
    device = next(model.parameters()).device

    def logits(batch: dict) -> torch.Tensor:
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            return response_logits(model, {k: v.to(device) for k, v in batch.items()}, keep)

    return logits


def greedy_answers(folder: str) -> tuple[list[dict], bool]:
    """The records of a distill-data folder, and whether they are the target's greedy answers (exact τ applies)."""
    records = load_distill_records(folder, allow_incomplete=True)
    path = Path(folder) / "distill_config.json"
    setup = json.loads(path.read_text()) if path.is_file() else {}
    return records, setup.get("temperature") == 0 and setup.get("policy", "target") == "target"


def make_evaluate(config: FinetuneConfig, target_model, target, heldout: list[dict], pad_id: int, eos: tuple,
                  keep: torch.Tensor | None = None):
    """evaluate(model) for the trainer: held-out loss, TVD, forward KL and block efficiency at each γ; with
    ``eval_data``, those on its records, and on the target's greedy answers the exact greedy τ
    (:mod:`specdraft.training.exact_tau`)."""
    from specdraft.training.exact_tau import greedy_tau, response_ranks

    heldout, exact = greedy_answers(config.eval_data) if config.eval_data else (heldout, False)
    longest = max(len(r["prompt_token_ids"]) + len(r["response_token_ids"]) for r in heldout)
    dataset = DistillDataset(heldout, longest if config.eval_data else config.max_seq_len)  # eval_data: whole, as run
    batches = [collate_distill([dataset[i] for i in range(s, min(s + config.batch_size, len(dataset)))], pad_id)
               for s in range(0, len(dataset), config.batch_size)]
    prompts = list(dict.fromkeys(tuple(r["prompt_token_ids"]) for r in heldout))[: config.eval_prompts]

    def evaluate(model) -> dict[str, float]:
        metrics = heldout_metrics(model, target_model, batches, config, keep)
        if exact:
            ranks = response_ranks(draft_logits_fn(model, keep, config.bf16), batches, keep, top=1)
            metrics |= greedy_tau(ranks, list(config.num_draft_tokens()))
        for k in config.num_draft_tokens():
            if prompts:
                metrics[f"block_efficiency@{k}"] = block_efficiency(target, model, prompts, k,
                                                                    config.eval_max_new_tokens, eos, keep)
        return metrics

    return evaluate


def load_models(config: FinetuneConfig):
    """(drafter to train, transformers target, target for decoding, target tokenizer), with the vocabularies
    checked before any training."""
    from specdraft.compat import check_compatible
    from specdraft.models.hf import HFCausalLM
    from specdraft.models.registry import load_model, load_tokenizer
    from specdraft.training.drafter_config import load_trained_drafter

    dtype = EXPORT_DTYPES[config.target_dtype]
    target, tokenizer = load_model(config.target, torch.float32), load_tokenizer(config.target)
    drafter = load_trained_drafter(config.drafter, target)  # a --share-embeddings export gets the target's table
    target_model = load_model(config.target, dtype, backend="hf").model.eval().requires_grad_(False)
    if config.freeze_embeddings:
        drafter.get_input_embeddings().weight.requires_grad_(False)  # tied: the LM head too
    if config.share_embeddings:
        _check_same_embeddings(drafter, target, config.drafter)
    draft_tokenizer = None  # a bare checkpoint: only the vocabulary size can be checked
    with contextlib.suppress(SpecdraftError):
        draft_tokenizer = load_tokenizer(config.drafter)
    check_compatible(target, tokenizer, HFCausalLM(drafter, name=config.drafter), draft_tokenizer)
    return drafter, target_model, target, tokenizer


def _check_same_embeddings(drafter, target, name: str) -> None:
    """--share-embeddings: the drafter's table must be the target's (up to bf16 rounding), or the exported drafter
    would draft from a table it was not trained with."""
    from specdraft.models.shared_embeddings import target_weights

    mine, theirs = drafter.get_input_embeddings().weight.detach().float(), target_weights(target)[0].detach().float()
    if mine.shape != theirs.shape or not torch.allclose(mine, theirs, rtol=1e-2, atol=1e-6):
        raise SpecdraftError(f"--share-embeddings: drafter {name!r} does not have the target's token embeddings "
                             f"(shape {tuple(mine.shape)} against {tuple(theirs.shape)}); start from "
                             "`specdraft init-drafter` or drop the flag")


def check_token_ids(records: list[dict], vocab_size: int, where: str) -> None:
    top = max(max(r["prompt_token_ids"] + r["response_token_ids"]) for r in records)
    if top >= vocab_size:
        raise SpecdraftError(f"{where} holds token id {top}, outside the target's vocabulary of {vocab_size}: "
                             "was it made with another target?")


@owns_out
def finetune(config: FinetuneConfig, command: str | None = None) -> Path:
    """Run stage 2 and export the aligned drafter; returns the exported folder ``<out>/model``."""
    from dataclasses import replace

    from specdraft.models.registry import eos_token_ids, resolve

    need_topk = config.use_stored_topk and config.loss != "ce"
    records = [record for folder in data_folders(config.data)
               for record in load_distill_records(folder, config.allow_incomplete, need_topk)]
    train_records, heldout = split_by_prompt(records, config.heldout_every)
    drafter, target_model, target, tokenizer = load_models(config)
    check_token_ids(records, target.vocab_size, config.data)
    plan, run_config = begin_stage("finetune", config, data_inputs(data_folders(config.data), drafter=config.drafter),
                                   export_path("").name)
    if plan.finished:
        return export_path(config.out)
    config = replace(config, bf16=run_config.bf16)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ranking = (load_token_ranking(resolve(config.draft_vocab_from), target.vocab_size) if config.draft_vocab_from
               else rank_tokens((r["response_token_ids"] for r in train_records), target.vocab_size))  # (V,)
    keep = ranking[: config.draft_vocab] if 0 < config.draft_vocab < target.vocab_size else None  # (N,)
    rank, _, device = init_distributed(config.device)
    target_model.to(device)
    keep = None if keep is None else keep.to(device)
    evaluate = make_evaluate(config, target_model, target, heldout, pad_id, eos_token_ids(tokenizer, config.target),
                             keep)
    pool = regenerate.regenerator(run_config, train_records, need_topk, target_model, tokenizer, keep)  # adds a pool
    result = train(drafter, DistillDataset(train_records, config.max_seq_len, need_topk),
                   make_kd_loss(config, target_model, keep), run_config, lambda items: collate_distill(items, pad_id),
                   evaluate, after_step=pool)
    if rank == 0 and result.steps == config.steps:
        trained = len(train_records) - (pool.size if pool else 0)
        data = (f"`{config.data}`: {trained} responses for training, {len(heldout)} held out"
                + ("; p approximated from the stored top-k log-probabilities" if need_topk else "")
                + (f"; {pool.size} of them answered afresh by the drafter every {config.regenerate_every} steps"
                   if pool else ""))
        export_hf(drafter.cpu(), export_path(plan.work), config.target, _card(config, result, command, data),
                  EXPORT_DTYPES[config.export_dtype], share_embeddings=config.share_embeddings, ranking=ranking,
                  options={"draft_vocab": config.draft_vocab} if keep is not None else None)
    end_stage(plan, config, result)
    return export_path(config.out)


def _card(config: FinetuneConfig, result: TrainResult, command: str | None, data: str) -> dict:
    budget = {"Budget": f"{result.steps} steps, {result.tokens:,} response tokens, {result.wall_seconds:.0f} s "
                        f"wall time ({result.tokens_per_second:.0f} tokens/s)",
              "Hardware": f"{hardware()}, {int(os.environ.get('WORLD_SIZE', 1))} process(es)",
              "Loss": f"{config.loss} {config.loss_options(None)}"}
    return {"title": f"specdraft drafter (distilled, {config.loss})", "command": command or shlex.join(sys.argv),
            "data": data, "budget": budget, "metrics": {"train_loss": result.train_loss} | result.eval,
            "config": asdict(config)}
