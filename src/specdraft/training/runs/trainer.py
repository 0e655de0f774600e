"""One small training loop for both stages of draft training (Goel et al. 2024, arXiv 2403.00858): pretraining
on text and fine-tuning by distillation differ only in their dataset, loss function and evaluation.

The loop: AdamW; linear warm-up then cosine decay to ``min_lr_ratio * lr``; gradient accumulation; gradient-norm
clipping; optional bf16 autocast; a held-out evaluation callback (run under ``no_grad``; it picks its own
precision) every ``eval_every`` steps and at the end; tqdm progress (tokens/s, ETA); ``train_log.csv`` and
``eval_log.csv`` (and tensorboard when it is installed; a resumed run first drops the rows a killed run logged after
its checkpoint); a training checkpoint every ``checkpoint_every`` steps and at the end.

Resuming continues to exactly the weights of an uninterrupted run: the data order is a seeded permutation per
epoch (seed and position are in the checkpoint), and the torch RNG, the loss's generator, the optimizer and the
schedule are restored. Evaluation runs under a forked RNG so it never changes what training draws. The CPU's
arithmetic is pinned too: ``threads`` (torch's intra-op thread count) is set for the whole loop, because how a CPU
kernel splits its work over threads changes its rounding (SDPA and softmax backward on AVX2 differ by ~5e-7 between
1 and 2 threads); :func:`specdraft.training.runs.stages.begin_stage` records it in ``run.json`` and a resume takes
it back.

``device`` (auto: CUDA when visible) is not a setting of the weights: a run checkpointed on one device resumes on
another. The loss's generator stays on the CPU; the CUDA generator's state is checkpointed when training on CUDA.

Distributed: under ``torchrun`` (``WORLD_SIZE > 1``) the process group is initialised (gloo on CPU, nccl on CUDA),
the model is wrapped in ``DistributedDataParallel``, each global micro-batch of ``batch_size * world`` indices is
split by rank, and only rank 0 evaluates and writes logs and checkpoints.

With ``fsdp`` (and ``WORLD_SIZE > 1``) a sharded copy is trained instead (FSDP2 ``fully_shard`` on every decoder
layer, ``model.model.layers``, then on the root; rank 0's initial weights are broadcast, as DDP does). The caller's
``model`` stays a plain, full module on the CPU: at each evaluation and at the end every rank gathers the full
weights into it; rank 0 evaluates it on the device while the others wait at a barrier, and when ``train`` returns
it holds the trained weights on every rank (still on the CPU), so exporting it needs nothing special. Checkpoints
hold the full model and optimizer state (gathered by every rank with ``torch.distributed.checkpoint.state_dict``,
written by rank 0; the optimizer state is keyed by parameter name), so a run resumes only under the same ``fsdp``
setting. Gradient accumulation reduce-scatters after every micro-batch (FSDP2 has no ``no_sync``); clipping uses
the DTensor-aware ``clip_grad_norm_``.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.hardware import check_device_name, resolve_device
from specdraft.training.runs.checkpoint import CHECKPOINT_FILE, load_training_state, save_training_state
from specdraft.training.runs.folders import rewind_log

# loss_fn(model, batch, generator) -> (scalar loss, number of counted tokens in the batch)
LossFn = Callable[[nn.Module, object, torch.Generator], tuple[torch.Tensor, int]]
EvalFn = Callable[[nn.Module], dict[str, float]]
CPU = torch.device("cpu")
StepHook = Callable[[int, nn.Module], None]  # after_step(step, model): e.g. refresh data in place (same size)


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """Settings shared by every training stage."""

    out: str = field(metadata={"help": "run folder: checkpoint, logs and the exported model"})
    steps: int = field(default=1000, metadata={"help": "optimizer steps"})
    batch_size: int = field(default=16, metadata={"help": "sequences per micro-batch (per process)"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "final learning rate as a fraction of lr"})
    warmup_steps: int = field(default=0, metadata={"help": "linear warm-up steps"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping norm (0 = off)"})
    bf16: bool | None = field(default=None, metadata={
        "help": "bf16 autocast; unset = auto: on where the machine has native bf16 (AVX-512-BF16/AMX CPUs, CUDA), "
                "off elsewhere, where emulated bf16 is several times slower than fp32"})
    eval_every: int = field(default=0, metadata={"help": "evaluate every N steps (0 = only at the end)"})
    checkpoint_every: int = field(default=0, metadata={"help": "save a training checkpoint every N steps (0 = end)"})
    log_every: int = field(default=10, metadata={"help": "write a train_log.csv row every N steps"})
    seed: int = field(default=0, metadata={"help": "seed of the initialisation, data order and loss sampling"})
    resume: bool = field(default=False, metadata={"help": "continue the run in the run folder (same settings and "
                                                          "inputs, or it is refused)"})
    overwrite: bool = field(default=False, metadata={"help": "replace the run in the run folder (the new run is "
                                                             "built beside it and swapped in when finished)"})
    stop_after: int | None = field(default=None, metadata={"help": "stop after this step (schedule keeps `steps`)"})
    group_by_length: bool = field(default=False, metadata={
        "help": "batch examples of similar length together (within windows of 32 batches of the epoch's shuffled "
                "order; the batches' order is shuffled again): less padding, the same examples each epoch"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})
    fsdp: bool = field(default=False, metadata={"help": "under torchrun, shard the model, gradients and optimizer "
                                                        "state with FSDP2 instead of replicating it with DDP"})
    device: str = field(default="auto", metadata={
        "help": "where to train: auto (CUDA when visible, else the CPU), cpu, cuda or cuda:N; under torchrun each "
                "process takes cuda:LOCAL_RANK (nccl), or the CPU (gloo)"})
    threads: int | None = field(default=None, metadata={
        "help": "CPU threads of the training arithmetic (torch intra-op threads); unset = this process's setting "
                "when the run starts, and a resumed run's recorded count: the rounding of CPU kernels depends on "
                "how their work is split over threads"})

    def __post_init__(self) -> None:
        check_ints(self, ("steps", "batch_size", "grad_accum", "log_every"), 1)
        check_ints(self, ("warmup_steps", "eval_every", "checkpoint_every"), 0)
        check_field(self, "lr", lambda v: v > 0 and math.isfinite(v), "a positive number")
        check_field(self, "min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1]")
        check_field(self, "weight_decay", lambda v: v >= 0, ">= 0")
        check_field(self, "max_grad_norm", lambda v: v >= 0, ">= 0")
        check_field(self, "fsdp", lambda v: isinstance(v, bool), "True or False")
        check_field(self, "group_by_length", lambda v: isinstance(v, bool), "True or False")
        check_field(self, "bf16", lambda v: v is None or isinstance(v, bool), "True, False or unset (auto)")
        check_field(self, "device", lambda v: check_device_name(v) is None, "auto, cpu, cuda or cuda:N")  # exists?
        check_field(self, "threads", lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
                    "unset or an integer >= 1")
        if self.resume and self.overwrite:
            raise SpecdraftError("resume and overwrite exclude each other: continue the run or replace it")
        check_field(self, "stop_after", lambda v: v is None or 1 <= v <= self.steps,
                    f"None or in 1 .. steps={self.steps}")
        if not str(self.out).strip():
            raise SpecdraftError("out must be a folder path, got an empty string")


def check_field(config, name: str, ok: Callable[[object], bool], what: str) -> None:
    """Raise ``SpecdraftError`` naming ``name`` unless ``ok(config.name)`` (a ``TypeError`` in ``ok`` counts as no)."""
    value = getattr(config, name)
    try:
        good = ok(value)
    except (TypeError, ValueError):
        good = False
    if not good:
        raise SpecdraftError(f"{name} must be {what}, got {value!r}")


def check_ints(config, names: tuple[str, ...], minimum: int) -> None:
    """Every field in ``names`` is an integer >= ``minimum``."""
    for name in names:
        check_field(config, name, lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= minimum,
                    f"an integer >= {minimum}")


def check_choices(config, names: tuple[str, ...], choices) -> None:
    """Every field in ``names`` is one of ``choices`` (any container of names)."""
    for name in names:
        check_field(config, name, lambda v: v in choices, f"one of {', '.join(choices)}")


@dataclass
class TrainResult:
    """What a run did: steps, tokens seen (all processes), wall time, last training loss and evaluation."""

    steps: int
    tokens: int
    wall_seconds: float
    train_loss: float
    eval: dict[str, float]

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak lr at ``step`` (0-based): linear warm-up to 1, then cosine decay to ``min_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


GROUP_WINDOW = 32  # batches sorted together by ``group_by_length``


class BatchStream:
    """A seeded, resumable order of micro-batches: epoch e visits ``randperm(n, seed, e)`` in chunks of
    ``batch_size * world`` indices (the ragged tail is skipped) and rank r takes its ``batch_size`` slice.

    With ``lengths`` (one per example) the epoch's order is grouped by length (:func:`grouped_order`): each global
    batch holds examples of similar length, so a right-padded batch wastes little; the ranks of one global batch
    get neighbouring lengths."""

    def __init__(self, size: int, batch_size: int, seed: int, rank: int = 0, world: int = 1,
                 lengths: list[int] | None = None) -> None:
        if size < batch_size * world:
            raise SpecdraftError(f"dataset has {size} examples, fewer than one global batch of {batch_size * world}")
        if lengths is not None and len(lengths) != size:
            raise SpecdraftError(f"{len(lengths)} lengths for {size} examples")
        self.size, self.batch_size, self.seed, self.rank, self.world = size, batch_size, seed, rank, world
        self.lengths = None if lengths is None else torch.as_tensor(lengths)
        self.epoch, self.offset = 0, 0
        self._order: tuple[int, torch.Tensor] | None = None

    def _permutation(self) -> torch.Tensor:
        if self._order is None or self._order[0] != self.epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(self.size, generator=generator)
            if self.lengths is not None:
                order = grouped_order(order, self.lengths, self.batch_size * self.world, generator)
            self._order = (self.epoch, order)
        return self._order[1]

    def next_indices(self) -> list[int]:
        chunk = self.batch_size * self.world
        if self.offset + chunk > self.size:
            self.epoch, self.offset = self.epoch + 1, 0
        indices = self._permutation()[self.offset : self.offset + chunk]
        self.offset += chunk
        return indices[self.rank * self.batch_size : (self.rank + 1) * self.batch_size].tolist()

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "offset": self.offset, "size": self.size}

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != self.size or state["seed"] != self.seed:
            raise SpecdraftError(f"cannot resume: checkpoint data had {state['size']} examples and seed "
                                 f"{state['seed']}, this run {self.size} and {self.seed}")
        self.epoch, self.offset = state["epoch"], state["offset"]


def grouped_order(order: torch.Tensor, lengths: torch.Tensor, chunk: int, generator: torch.Generator) -> torch.Tensor:
    """``order`` (n,) regrouped by length: each window of :data:`GROUP_WINDOW` chunks of ``chunk`` indices is sorted
    by length (longest first), cut into chunks, and the whole chunks of the epoch are shuffled with ``generator``;
    the ragged tail (fewer than ``chunk`` indices) stays last. Every index of ``order`` appears once.

    Args:
        order: (n,) a permutation of the examples.
        lengths: (n,) each example's length (tokens).
    """
    whole = order.shape[0] // chunk * chunk
    windows = order[:whole].split(chunk * GROUP_WINDOW)
    ranked = [w[lengths[w].argsort(descending=True, stable=True)] for w in windows]  # each (<= W * chunk,)
    chunks = torch.cat(ranked).view(-1, chunk) if ranked else order[:0].view(0, chunk)  # (whole / chunk, chunk)
    shuffled = chunks[torch.randperm(chunks.shape[0], generator=generator)]
    return torch.cat([shuffled.reshape(-1), order[whole:]])


def init_distributed(device: str = "auto") -> tuple[int, int, torch.device]:
    """(rank, world size, torch device) for ``device`` (auto, cpu, cuda, cuda:N); under torchrun, initialises the
    process group: nccl when the processes run on CUDA (each on cuda:LOCAL_RANK), gloo on the CPU."""
    import torch.distributed as dist

    world, local = int(os.environ.get("WORLD_SIZE", 1)), os.environ.get("LOCAL_RANK", "0")
    if world > 1 and ":" in str(device) and str(device) != f"cuda:{local}":
        raise SpecdraftError(f"device {device!r}: under torchrun each process uses cuda:LOCAL_RANK; pass --device cuda "
                             "(or auto) and choose the GPUs with CUDA_VISIBLE_DEVICES")
    try:
        chosen = resolve_device(device).device
    except ValueError as exc:
        raise SpecdraftError(str(exc)) from None
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
    if world <= 1:
        return 0, 1, chosen
    if not dist.is_initialized():
        dist.init_process_group("nccl" if chosen.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), chosen


def barrier(world: int) -> None:
    """Wait for every process (a no-op outside distributed runs)."""
    import torch.distributed as dist

    if world > 1 and dist.is_initialized():
        dist.barrier()


class RunLog:
    """``train_log.csv`` and ``eval_log.csv`` in the run folder, plus tensorboard if importable; a no-op on ranks
    other than 0. They start at ``step``, the step the run starts from: a fresh run (0) starts fresh logs, a resumed
    one keeps the rows up to its checkpoint's step and drops those a killed run wrote after it, so each step is logged
    once."""

    def __init__(self, out: Path, enabled: bool, step: int = 0) -> None:
        self.out, self.enabled, self.writer = out, enabled, None
        if enabled:
            out.mkdir(parents=True, exist_ok=True)
            for name in ("train", "eval"):
                rewind_log(out / f"{name}_log.csv", step)
            with contextlib.suppress(ImportError):  # tensorboard is optional
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=step + 1 if step else None)

    def write(self, name: str, row: dict) -> None:
        if not self.enabled:
            return
        path = self.out / f"{name}_log.csv"
        new = not path.is_file()
        with open(path, "a", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=list(row), extrasaction="ignore")
            if new:
                writer.writeheader()
            writer.writerow({k: f"{v:.6g}" if isinstance(v, float) else v for k, v in row.items()})
        if self.writer is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(f"{name}/{key}", value, row["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


@dataclass
class _Run:
    """The mutable state of one training run (everything a checkpoint holds). Under FSDP ``model`` is the sharded
    copy being trained and ``full`` the caller's plain model, which receives the gathered weights."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    stream: BatchStream
    generator: torch.Generator
    step: int = 0
    tokens: int = 0
    wall_seconds: float = 0.0
    full: nn.Module | None = None
    device: torch.device = CPU

    def state_dict(self, config: TrainerConfig) -> dict:
        """The checkpoint; under FSDP a collective (every rank calls it) whose model and optimizer state are full
        on rank 0 only (empty elsewhere)."""
        return {
            **self._weights_state(), "scheduler": self.scheduler.state_dict(), "step": self.step,
            "tokens": self.tokens, "wall_seconds": self.wall_seconds, "data": self.stream.state_dict(),
            "config": _plain(asdict(config)),
            "rng": {"torch": torch.get_rng_state(), "loss": self.generator.get_state()}
            | ({"cuda": torch.cuda.get_rng_state(self.device)} if self.device.type == "cuda" else {}),
        }

    def _weights_state(self) -> dict:
        if self.full is None:
            return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model, optimizer = get_state_dict(self.model, self.optimizer, options=options)
        return {"model": model, "optimizer": optimizer}

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint (under FSDP every rank passes the full state it read)."""
        by_name = any(isinstance(p, str) for group in state["optimizer"]["param_groups"] for p in group["params"])
        if by_name != (self.full is not None):
            raise SpecdraftError(f"cannot resume: the checkpoint was written {'with' if by_name else 'without'} FSDP "
                                 f"sharding and this run is {'not ' if by_name else ''}sharded (fsdp shards only "
                                 "when WORLD_SIZE > 1); resume with the same fsdp setting")
        if self.full is None:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"], options=StateDictOptions(full_state_dict=True))
        self.scheduler.load_state_dict(state["scheduler"])
        self.stream.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and self.device.type == "cuda":  # a run resumed on the CPU has no CUDA draws
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
        self.generator.set_state(state["rng"]["loss"])
        self.step, self.tokens, self.wall_seconds = state["step"], state["tokens"], state["wall_seconds"]


def _plain(value):
    """A config dict with only JSON-like values (loadable with ``weights_only=True``)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


def _new_run(model: nn.Module, size: int, config: TrainerConfig, rank: int, world: int,
             full: nn.Module | None = None, device: torch.device = CPU, lengths: list[int] | None = None) -> _Run:
    trainable = [p for p in model.parameters() if p.requires_grad]  # frozen tables (finetune --freeze-embeddings)
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, betas=(0.9, 0.95),
                                  weight_decay=config.weight_decay)
    schedule = lambda step: lr_factor(step, config.warmup_steps, config.steps, config.min_lr_ratio)  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    stream = BatchStream(size, config.batch_size, config.seed, rank, world, lengths)
    return _Run(model, optimizer, scheduler, stream, torch.Generator().manual_seed(config.seed), full=full,
                device=device)


def fully_shard_copy(model: nn.Module, device: torch.device) -> nn.Module:
    """An FSDP2-sharded copy of ``model`` on ``device`` holding rank 0's weights (a collective; ``model`` is left as
    it is). Each decoder layer (``model.model.layers`` of a transformers Llama) is one shard group, the rest the root.

    The copy starts with its parameters on the meta device (no second full copy in memory); its buffers, such as the
    non-persistent rotary ``inv_freq``, are copied from ``model``.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in model.parameters()}
    sharded = copy.deepcopy(model, memo)
    for layer in getattr(getattr(sharded, "model", None), "layers", []):
        fully_shard(layer)
    fully_shard(sharded)
    sharded.to_empty(device=device)
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, buffer in sharded.named_buffers():
            buffer.copy_(buffers[name])
    set_model_state_dict(sharded, model.state_dict(),
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return sharded.train(model.training)


def gather_full(sharded: nn.Module, full: nn.Module) -> nn.Module:
    """Copy the weights of an FSDP-sharded module into its plain twin ``full`` (a collective: every rank calls it;
    one full tensor at a time is gathered) and return ``full``."""
    from torch.distributed.tensor import DTensor

    target = full.state_dict()
    with torch.no_grad():
        for name, value in sharded.state_dict().items():
            target[name].copy_(value.full_tensor() if isinstance(value, DTensor) else value)
    return full


def _to(batch, device: torch.device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(v, device) for v in batch)
    return batch


def _train_step(run: _Run, wrapped: nn.Module, dataset, collate, loss_fn: LossFn, config: TrainerConfig,
                device: torch.device) -> tuple[float, int, float]:
    """One optimizer step over ``grad_accum`` micro-batches -> (mean loss, tokens on this rank, grad norm)."""
    total, tokens = 0.0, 0
    for micro in range(config.grad_accum):
        batch = _to(collate([dataset[i] for i in run.stream.next_indices()]), device)
        last = micro == config.grad_accum - 1
        sync = contextlib.nullcontext() if last or not hasattr(wrapped, "no_sync") else wrapped.no_sync()
        with sync:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.bf16):
                loss, count = loss_fn(wrapped, batch, run.generator)
            (loss / config.grad_accum).backward()
        total, tokens = total + float(loss.detach()), tokens + int(count)
    norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), config.max_grad_norm or float("inf"))
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: a DTensor
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return total / config.grad_accum, tokens, float(norm)


def _evaluate(model: nn.Module, evaluate: EvalFn | None) -> dict:
    if evaluate is None:
        return {}
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            return dict(evaluate(model))
    finally:
        model.train()


def _evaluate_on_rank0(run: _Run, evaluate: EvalFn | None, device: torch.device, main: bool, world: int) -> dict:
    """Rank 0's evaluation of the current weights; under FSDP every rank first gathers them into the plain model,
    which rank 0 evaluates on ``device`` while the others wait."""
    if evaluate is None:
        return {}
    if run.full is None:
        return _evaluate(run.model, evaluate) if main else {}
    model = gather_full(run.model, run.full)
    try:
        return _evaluate(model.to(device), evaluate) if main else {}
    finally:
        model.cpu()
        barrier(world)


def train(model: nn.Module, dataset, loss_fn: LossFn, config: TrainerConfig, collate: Callable | None = None,
          evaluate: EvalFn | None = None, after_step: StepHook | None = None) -> TrainResult:
    """Train ``model`` in place on ``dataset`` (indexable) with ``loss_fn``; see the module docstring.
    ``after_step(step, model)`` runs on every process after each optimizer step, before evaluation and checkpoint."""
    rank, world, device = init_distributed(config.device)
    if config.bf16 is None:  # auto: callers that skip begin_stage get the machine's choice too
        from dataclasses import replace

        from specdraft.hardware import resolve_bf16

        config = replace(config, bf16=resolve_bf16(None, device).bf16)
    collate = collate or torch.utils.data.default_collate
    out = Path(config.out)
    sharded = config.fsdp and world > 1
    model.to("cpu" if sharded else device).train()
    lengths = example_lengths(dataset) if config.group_by_length else None
    if sharded:
        run = _new_run(fully_shard_copy(model, device), len(dataset), config, rank, world, full=model, device=device,
                       lengths=lengths)
    else:
        run = _new_run(model, len(dataset), config, rank, world, device=device, lengths=lengths)
    if config.resume:  # a missing or damaged checkpoint is a SpecdraftError
        run.load_state_dict(load_training_state(out / CHECKPOINT_FILE))
    wrapped = run.model
    if world > 1 and not sharded:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    log = RunLog(out, rank == 0, run.step)  # the logs as of the checkpoint resumed from (fresh at step 0)
    try:
        with pinned_threads(config.threads):
            result = _loop(run, wrapped, dataset, collate, loss_fn, evaluate, config, device, log, world, after_step)
    finally:
        log.close()
    if sharded:
        gather_full(run.model, model)
    return result


@contextlib.contextmanager
def pinned_threads(threads: int | None):
    """Run the block with ``threads`` torch intra-op threads (None: as they are), then restore the count."""
    before = torch.get_num_threads()
    if threads is not None and threads != before:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def example_lengths(dataset) -> list[int]:
    """Each example's length for ``group_by_length``: the dataset's ``lengths`` (a list, one per example)."""
    lengths = getattr(dataset, "lengths", None)
    if lengths is None:
        raise SpecdraftError(f"group_by_length needs examples of different lengths; {type(dataset).__name__} "
                             "has no per-example lengths (its examples are one length: leave group_by_length off)")
    return list(lengths)


def _loop(run: _Run, wrapped, dataset, collate, loss_fn, evaluate, config: TrainerConfig, device, log: RunLog,
          world: int, after_step: StepHook | None = None) -> TrainResult:
    from tqdm import tqdm

    main = log.enabled
    last = config.stop_after or config.steps
    bar = tqdm(total=config.steps, initial=run.step, unit="step", disable=not (config.progress and main),
               desc=Path(config.out).name)
    loss, metrics, started, wall_before = float("nan"), {}, time.perf_counter(), run.wall_seconds
    while run.step < last:
        loss, tokens, norm = _train_step(run, wrapped, dataset, collate, loss_fn, config, device)
        run.step, run.tokens = run.step + 1, run.tokens + tokens * world
        run.wall_seconds = wall_before + time.perf_counter() - started
        rate = run.tokens / max(run.wall_seconds, 1e-9)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rate:.0f}")
        if after_step is not None:
            after_step(run.step, run.model)
        if main and (run.step % config.log_every == 0 or run.step == last):
            log.write("train", {"step": run.step, "tokens": run.tokens, "lr": run.scheduler.get_last_lr()[0],
                                "loss": loss, "grad_norm": norm, "tokens_per_s": rate, "wall_s": run.wall_seconds})
        if run.step == last or (config.eval_every and run.step % config.eval_every == 0):
            metrics = _evaluate_on_rank0(run, evaluate, device, main, world)
            if metrics:
                log.write("eval", {"step": run.step, "tokens": run.tokens} | metrics)
                bar.write(f"step {run.step}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
        if run.step == last or (config.checkpoint_every and run.step % config.checkpoint_every == 0):
            state = run.state_dict(config) if main or run.full is not None else None  # FSDP: every rank gathers
            if main:
                save_training_state(Path(config.out) / CHECKPOINT_FILE, state)
    bar.close()
    return TrainResult(run.step, run.tokens, run.wall_seconds, loss, metrics)
