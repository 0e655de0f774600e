"""``specdraft train-drafter --config recipe.toml``: the whole draft-training recipe from one TOML or JSON file, from
prompts to an exported drafter (Goel et al. 2024, arXiv 2403.00858) and, optionally, EAGLE-3 heads.

Sections, run in this order (``[finetune]`` may be one table or several ``[[finetune]]`` phases):

- ``[heldout_data]`` (optional): the target's greedy answers to held-out questions (e.g. Spec-Bench's): every
  training stage evaluates on them, the drafter with its exact greedy τ (:mod:`specdraft.training.objectives.tau`);
- ``[distill_data]``: the target's answers to the training prompts (:mod:`specdraft.training.data.distill_data`);
- ``[pretrain]`` or ``[init_drafter]``: the drafter to start from (trained from scratch, or the target's layers);
- ``[finetune]`` / ``[[finetune]]``: distillation; each phase starts from the previous one's export, on
  ``[distill_data]`` unless it names its data;
- ``[heads]`` (optional): ``train-heads`` on the same data (default kind ``eagle3``).

Top-level ``target`` and ``device`` apply to every section that has the setting. Two keys of a training section
belong to the recipe, not to the stage: ``budget_s`` (seconds: the stage's first steps are timed and ``steps`` is
lowered to what fits, :func:`fit_budget`) and ``evals`` (evaluations, with a checkpoint at each, spread over the
steps: the learning curve in the stage's ``eval_log.csv``).

A stage whose folder holds a run of the same settings and inputs is continued, or reused when finished; a changed one
is refused naming its section, or rebuilt beside the old run with ``overwrite``. ``stages`` runs only the named
sections (the others still give their outputs as inputs), e.g. the heads alone after the drafter. Under torchrun
every stage splits its work by rank (data shards, DDP or FSDP training), and rank 0 alone copies the drafter's layers.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import time
import tomllib
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path

from specdraft.errors import SpecdraftError
from specdraft.hardware import resolve_bf16, resolve_device
from specdraft.training.data.distill_data import DistillDataConfig, distill_changes, generate_distillation_data
from specdraft.training.data.records import data_folders
from specdraft.training.drafter.finetune import finetune
from specdraft.training.drafter.finetune_config import FinetuneConfig
from specdraft.training.drafter.init_drafter import InitDrafterConfig, init_drafter
from specdraft.training.drafter.pretrain import PretrainConfig, pretrain, source_inputs
from specdraft.training.heads.train_heads import HEADS_FOLDER, HeadsConfig, train_heads
from specdraft.training.runs.checkpoint import export_path, is_complete_export
from specdraft.training.runs.folders import RUN_FILE, note, stage_changes, staging_path
from specdraft.training.runs.stages import data_inputs
from specdraft.training.runs.trainer import barrier, init_distributed

SECTIONS = ("heldout_data", "distill_data", "pretrain", "init_drafter", "finetune", "heads")
SHARED = ("target", "device")  # top-level keys every section that has the setting takes
RECIPE_KEYS = ("budget_s", "evals")  # read by the recipe, not by the stage
TRAINING = ("pretrain", "finetune", "heads")  # the sections that train (and take the recipe keys)
CALIBRATION_STEPS = 20  # steps timed before a budgeted stage's steps are fitted


@dataclass(frozen=True)
class Stage:
    """One section of a recipe: its name in messages, the config it runs, and the recipe's own keys."""

    name: str
    section: str
    config: object
    budget_s: float | None = None
    evals: int | None = None


def load_pipeline_file(path: str | Path) -> dict:
    """The sections of a recipe file: ``.toml`` (tomllib) or JSON."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        spec = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except OSError as exc:
        raise SpecdraftError(f"cannot read pipeline file {path}: {exc.strerror}") from None
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise SpecdraftError(f"malformed pipeline file {path}: {exc}") from None
    if not isinstance(spec, dict):
        raise SpecdraftError(f"{path}: expected a table of sections {', '.join(SECTIONS)}")
    unknown = sorted(set(spec) - {*SECTIONS, *SHARED})
    if unknown:
        raise SpecdraftError(f"{path}: unknown key {unknown[0]!r}")
    tables = [spec.get(s, {}) for s in SECTIONS if s != "finetune"]
    phases = spec.get("finetune", {})
    phases = phases if isinstance(phases, list) else [phases]
    if not all(isinstance(t, dict) for t in [*tables, *phases]):
        raise SpecdraftError(f"{path}: sections must be tables")
    return spec


def _build(cls: type, section: str, values: dict, shared: dict):
    names = {f.name for f in fields(cls)}
    values = {k: v for k, v in shared.items() if k in names} | values
    unknown = sorted(set(values) - names)
    if unknown:
        raise SpecdraftError(f"[{section}] has no setting {unknown[0]!r}; known: {', '.join(sorted(names))}")
    try:
        return cls(**values)
    except TypeError as exc:
        raise SpecdraftError(f"[{section}]: {exc}") from None


def _stage(cls: type, name: str, section: str, values: dict, shared: dict) -> Stage:
    """A training section's stage: its recipe keys taken out and checked, the rest built into ``cls``."""
    extra = {k: values[k] for k in RECIPE_KEYS if k in values}
    budget, evals = extra.get("budget_s"), extra.get("evals")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0):
        raise SpecdraftError(f"[{name}] budget_s must be a positive number of seconds, got {budget!r}")
    if evals is not None and (isinstance(evals, bool) or not isinstance(evals, int) or evals < 1):
        raise SpecdraftError(f"[{name}] evals must be an integer >= 1, got {evals!r}")
    config = _build(cls, name, {k: v for k, v in values.items() if k not in RECIPE_KEYS}, shared)
    return Stage(name, section, config, budget, evals)


def pipeline_configs(spec: dict) -> list[Stage]:
    """The recipe's stages in order, every config validated; a later stage's inputs default to the outputs of the
    stages before it (see the module docstring)."""
    classes = {"distill_data": DistillDataConfig, "heldout_data": DistillDataConfig, "pretrain": PretrainConfig,
               "init_drafter": InitDrafterConfig, "finetune": FinetuneConfig, "heads": HeadsConfig}
    for section, cls in classes.items():  # a misspelt setting is named before any config is built
        known = {f.name for f in fields(cls)} | (set(RECIPE_KEYS) if section in TRAINING else set())
        for table in spec.get(section, []) if isinstance(spec.get(section), list) else [spec.get(section, {})]:
            unknown = sorted(set(table) - known)
            if unknown:
                raise SpecdraftError(f"[{section}] has no setting {unknown[0]!r}; known: {', '.join(sorted(known))}")
    for needed in ("distill_data", "finetune"):
        if needed not in spec:
            raise SpecdraftError(f"pipeline file lacks the [{needed}] section")
    if ("pretrain" in spec) == ("init_drafter" in spec):
        raise SpecdraftError("pipeline file needs one of [pretrain] and [init_drafter] (the drafter to start from)")
    shared = {k: spec[k] for k in SHARED if k in spec}
    data = _build(DistillDataConfig, "distill_data", spec["distill_data"], shared)
    stages, evaluation = [], {}
    if "heldout_data" in spec:  # first: small, and every training stage evaluates on it
        heldout = _build(DistillDataConfig, "heldout_data", {"temperature": 0.0} | spec["heldout_data"], shared)
        stages.append(Stage("heldout_data", "heldout_data", heldout))
        evaluation = {"eval_data": heldout.out}
    stages.append(Stage("distill_data", "distill_data", data))
    if "pretrain" in spec:
        stages.append(_stage(PretrainConfig, "pretrain", "pretrain", spec["pretrain"], shared))
        drafter = str(export_path(stages[-1].config.out))
    else:
        stages.append(Stage("init_drafter", "init_drafter", _build(InitDrafterConfig, "init_drafter",
                                                                   spec["init_drafter"], shared)))
        drafter = stages[-1].config.out
    phases = spec["finetune"] if isinstance(spec["finetune"], list) else [spec["finetune"]]
    for number, phase in enumerate(phases, start=1):
        name = "finetune" if len(phases) == 1 else f"finetune {number}"
        defaults = {"drafter": drafter, "data": data.out} | evaluation
        stages.append(_stage(FinetuneConfig, name, "finetune", defaults | phase, shared))
        drafter = str(export_path(stages[-1].config.out))
    if "heads" in spec:
        defaults = {"kind": "eagle3", "data": data.out} | evaluation
        stages.append(_stage(HeadsConfig, "heads", "heads", defaults | spec["heads"], shared))
    return stages


def train_drafter(spec: dict, command: str | None = None, overwrite: bool = False,
                  only: tuple[str, ...] = ()) -> dict[str, Path]:
    """Run the recipe ``spec`` (see the module docstring); returns the exports: ``drafter`` (the last fine-tuning
    phase's folder) and ``heads`` when there is a ``[heads]`` section. ``only``: the sections to run (all when
    empty). Every config is validated before any stage starts."""
    stages = pipeline_configs(spec)
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        raise SpecdraftError(f"unknown stage {unknown[0]!r}; the sections are {', '.join(SECTIONS)}")
    progress = all(getattr(s.config, "progress", True) for s in stages)
    for stage in stages:
        if only and stage.section not in only:
            continue
        with _section(stage.name):
            _run_stage(stage, command, overwrite, progress, spec.get("device", "auto"))
    exports = {"drafter": export_path([s for s in stages if s.section == "finetune"][-1].config.out)}
    heads = [s for s in stages if s.section == "heads"]
    return exports | ({"heads": Path(heads[0].config.out) / HEADS_FOLDER} if heads else {})


def _run_stage(stage: Stage, command: str | None, overwrite: bool, progress: bool, device: str) -> None:
    config = stage.config
    if stage.section in ("distill_data", "heldout_data"):
        generate_distillation_data(config, overwrite=overwrite and bool(distill_changes(config)), progress=progress)
    elif stage.section == "init_drafter":
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        if rank == 0 and not is_complete_export(config.out):  # made once: its fingerprint is the next stage's input
            init_drafter(config, command=command)
        if world > 1:
            init_distributed(device)
            barrier(world)
    else:
        run, inputs, export = _training(stage)
        config = fit_budget(stage, run, export, command, overwrite)
        training_stage(run, config, inputs, export, overwrite, command)


def _training(stage: Stage):
    """(run function, inputs function, export folder name) of a training stage."""
    config = stage.config
    if stage.section == "pretrain":
        return pretrain, lambda: source_inputs(config), "model"
    if stage.section == "finetune":
        return finetune, lambda: data_inputs(data_folders(config.data), drafter=config.drafter), "model"
    return train_heads, lambda: data_inputs([config.data], init_heads=config.init_heads), HEADS_FOLDER


@contextlib.contextmanager
def _section(name: str):
    """Name the pipeline file's section in a stage's error."""
    try:
        yield
    except SpecdraftError as exc:
        raise SpecdraftError(f"[{name}] {exc}") from None


def training_stage(run, config, inputs, export: str, overwrite: bool, command: str | None) -> None:
    """Run one training stage of the pipeline: fresh, continued, reused, or (``overwrite``, when its settings or
    inputs changed) replaced."""
    if Path(config.out).exists() and (overwrite or config.overwrite):
        if stage_changes(_resolved(config), inputs(), export, _defaults(config), overwrite=True):
            run(replace(config, resume=False, overwrite=True), command=command)
            return
    resume = stage_changes(config, {}, export, {}) is not None
    run(replace(config, resume=resume, overwrite=False), command=command)


def _resolved(config):
    """``config`` as its run records it: ``bf16`` auto resolved on its device (and a pretraining budget applied)."""
    try:
        device = resolve_device(config.device).device
    except ValueError as exc:
        raise SpecdraftError(str(exc)) from None
    resolved = replace(config, bf16=resolve_bf16(config.bf16, device).bf16, overwrite=False)
    if hasattr(resolved, "with_budget"):
        resolved = resolved.with_budget(int(os.environ.get("WORLD_SIZE", 1)))
    return resolved


def _defaults(config) -> dict:
    return {f.name: f.default for f in fields(config) if f.default is not MISSING}


# --- time budgets ----------------------------------------------------------------------------------------------------


def spread_evals(config, evals: int | None):
    """``config`` with ``evals`` evaluations (and a checkpoint at each) spread evenly over its steps."""
    if not evals:
        return config
    every = max(1, math.ceil(config.steps / evals))
    return replace(config, eval_every=every, checkpoint_every=every)


def fit_budget(stage: Stage, run, export: str, command: str | None, overwrite: bool = False):
    """The stage's config, its steps lowered to fit ``stage.budget_s`` seconds of wall time (loading and evaluations
    included), with ``stage.evals`` spread over them.

    A fresh run's first :data:`CALIBRATION_STEPS` steps are run and timed (a real run, stopped there: evaluated and
    checkpointed; the rate is the later half's, :func:`_step_seconds`). When the rest fits, the run continues from
    there; otherwise it starts again with the steps that fit (the timed steps are lost: its schedule changed). A run
    already in the folder is continued as it is; unless ``overwrite`` (the stage is to be redone where it changed),
    with the steps a budget gave it (:func:`_fitted_run`): a recipe stopped part-way and run again picks up where it
    was, and a finished one is reused."""
    config = spread_evals(stage.config, stage.evals)
    if stage.budget_s is None:
        return config
    if stage_changes(config, {}, export, {}) is not None:  # a run is there: continued, with the steps it was given
        return (None if overwrite else _fitted_run(stage, config, export)) or config
    probe = min(CALIBRATION_STEPS, config.steps)
    started = time.perf_counter()
    run(replace(config, stop_after=probe, log_every=1, resume=False, overwrite=False), command=command)
    spent = time.perf_counter() - started
    if probe == config.steps:  # the timed steps were the whole run
        return config
    per_step = _step_seconds(Path(config.out))
    fixed = max(spent - per_step * probe, 0.0)  # loading, evaluation and checkpoint: paid again by the next start
    evals = (stage.evals or 1) + 1
    if spent + fixed * (1 + evals / 4) + per_step * (config.steps - probe) <= stage.budget_s:
        return config
    steps = min(config.steps - 1, max(probe + 1, int((stage.budget_s - spent - fixed * (1 + evals / 4)) / per_step)))
    note(f"[{stage.name}] {per_step * 1000:.0f} ms a step over the first {probe} (and {fixed:.0f} s to load, "
         f"evaluate and save): {steps} steps fit budget_s={stage.budget_s:g}, not {config.steps}; started again")
    return replace(spread_evals(replace(config, steps=steps), stage.evals), overwrite=True)


def _fitted_run(stage: Stage, config, export: str):
    """The config that continues a run of this stage whose steps a budget lowered, or None when there is none: the
    run in its staging folder (started again with fewer steps, stopped before it replaced the timed one) or in its
    folder (finished), when its settings are the stage's but for the steps."""
    for folder, overwrite in ((staging_path(config.out), True), (Path(config.out), False)):
        try:
            steps = json.loads((folder / RUN_FILE).read_text())["settings"]["steps"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not isinstance(steps, int) or steps >= config.steps:
            continue
        fitted = spread_evals(replace(stage.config, steps=steps), stage.evals)
        if not stage_changes(_resolved(replace(fitted, out=str(folder))), {}, export, _defaults(fitted)):
            return replace(fitted, overwrite=overwrite)
    return None


def _step_seconds(folder: Path) -> float:
    """Seconds a training step of a run takes, from the ``train_log.csv`` of its first steps (logged each step): the
    later half's, so that a first steps' warm-up (a CUDA device's first kernels, 15x a later step on an
    H200) does not set the rate; the whole span's where the log has no row at the half."""
    try:
        with open(folder / "train_log.csv", newline="") as file:
            wall = {int(row["step"]): float(row["wall_s"]) for row in csv.DictReader(file)}
        last = max(wall)
    except (OSError, KeyError, ValueError):
        raise SpecdraftError(f"{folder}: no train_log.csv to time the first steps by") from None
    half = last // 2
    if half in wall and last > half:
        return (wall[last] - wall[half]) / (last - half)
    return wall[last] / last
