"""The start and end of a training stage (``pretrain``, ``finetune``, ``train-heads``) in its run folder: the device
and bf16 auto resolved (the device recorded in ``run.json``, never part of the run's fingerprint), the CPU
arithmetic pinned (the thread count recorded in ``run.json`` and taken back by a resume, with the CPU, kernel level
and torch build beside it: a resume where those differ says so), the folder checked against the run's settings and
inputs (:mod:`specdraft.training.runs.folders`), and a replacement swapped in at the end."""

from __future__ import annotations

import os
from dataclasses import MISSING, fields, replace

from specdraft.hardware import resolve_bf16
from specdraft.models.registry import resolve, resolve_heads
from specdraft.training.runs.folders import (
    RunPlan,
    arithmetic_changes,
    arithmetic_record,
    data_fingerprint,
    finish_run,
    folder_fingerprint,
    note,
    plan_run,
    recover,
    resumed_threads,
    start_run,
)
from specdraft.training.runs.trainer import TrainerConfig, TrainResult, barrier, init_distributed


def data_inputs(folders: list[str], drafter: str = "", init_heads: str = "") -> dict[str, tuple[str, str]]:
    """Content fingerprints of a distillation stage's data folders (their shards' checksums, verified), and of the
    drafter or heads it starts from, if any."""
    inputs = {f"data:{folder}": (folder, data_fingerprint(folder)) for folder in folders}
    if drafter:
        inputs["drafter"] = (drafter, folder_fingerprint(resolve(drafter)))
    if init_heads:
        inputs["init_heads"] = (init_heads, folder_fingerprint(resolve_heads(init_heads)))
    return inputs


def device_record(asked: str, device) -> dict[str, str]:
    """What a run records of its device: the one it runs on and what was asked (``auto``, ``cpu``, ``cuda:N``)."""
    return {"device": str(device), "asked": asked}


def begin_stage(stage: str, config: TrainerConfig, inputs: dict[str, tuple[str, str]],
                export: str) -> tuple[RunPlan, TrainerConfig]:
    """Resolve ``bf16`` auto, check the run folder (:func:`~.folders.plan_run`: refuse a run of other
    settings or inputs, continue or replace one) and prepare it; returns the plan and the config to train with
    (``out`` the working folder, ``resume`` set). Every process calls it."""
    rank, world, device = init_distributed(config.device)
    choice = resolve_bf16(config.bf16, device)
    config = replace(config, bf16=choice.bf16)
    defaults = {f.name: f.default for f in fields(config) if f.default is not MISSING}
    if rank == 0:
        recover(config.out)  # a replacement killed between its two renames
    barrier(world)
    plan = plan_run(stage, config, inputs, export, defaults)
    threads = resumed_threads(plan, config.threads)
    arithmetic = arithmetic_record(threads)
    barrier(world)
    if rank == 0 and not plan.finished:
        changed = arithmetic_changes(plan, arithmetic)
        if changed:
            note(f"{config.out}: resumed with other arithmetic than its checkpoint was made with "
                 f"({'; '.join(changed)}): its weights will differ in their last bits from an uninterrupted run's")
        start_run(plan, choice.to_dict(), device_record(config.device, device), arithmetic)
    barrier(world)
    return plan, replace(config, out=str(plan.work), resume=plan.resume, overwrite=False, threads=threads)


def end_stage(plan: RunPlan, config: TrainerConfig, result: TrainResult) -> None:
    """After the export: mark a run that reached its last step finished and swap in a replacement (rank 0)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if rank == 0 and result.steps == config.steps:
        finish_run(plan)
    barrier(world)
