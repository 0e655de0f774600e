"""The draft-training subcommands of ``specdraft`` (Goel et al. 2024, arXiv 2403.00858): ``pretrain``,
``distill-data``, ``finetune``, and ``train-drafter`` that runs all three from one JSON or TOML file.

Each subcommand's flags are generated from its config dataclass (one flag per field, its help text from the
field's metadata, ``--x/--no-x`` for booleans), so the CLI and the library cannot drift apart. A handler builds
the config (whose validation raises :class:`SpecdraftError`, which the CLI turns into exit code 2) and calls one
library function. Register them with :func:`add_training_commands`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import tomllib
from dataclasses import MISSING, fields, replace
from pathlib import Path

from specdraft.errors import SpecdraftError
from specdraft.training.drafter_config import InitDrafterConfig
from specdraft.training.finetune import FinetuneConfig, data_folders, finetune
from specdraft.training.generation import DistillDataConfig, distill_changes, generate_distillation_data
from specdraft.training.pretrain import PretrainConfig, export_path, pretrain, source_inputs
from specdraft.training.stages import data_inputs
from specdraft.training.teacher import TeacherTopkConfig, annotate_topk

_TYPES = {"int": int, "float": float, "str": str, "int | None": int, "float | None": float, "str | None": str}
STAGES = ("pretrain", "distill_data", "finetune")


def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of the dataclass ``cls``; fields without a default are required flags."""
    for f in fields(cls):
        flag, text = "--" + f.name.replace("_", "-"), f.metadata.get("help", "")
        required = f.default is MISSING and f.default_factory is MISSING
        if f.type in ("bool", "bool | None"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=text)
        elif f.type in _TYPES:
            default = None if required else f.default
            shown = "" if required or default is None else f" (default: {default})"
            parser.add_argument(flag, type=_TYPES[f.type], default=default, required=required, help=text + shown)
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: no CLI mapping for type {f.type!r}")


def config_from_args(cls: type, args: argparse.Namespace):
    """An instance of ``cls`` from the parsed flags of :func:`add_config_arguments`."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def command_line(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> str:
    """The run as one canonical command line (for model cards): every flag with its parsed value, except the
    fields in ``skip`` (e.g. a default that another flag overrides)."""
    words = ["specdraft", args.subcommand]
    for key, value in vars(args).items():
        if key in ("command", "subcommand", "run", *skip) or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        words += ([flag] if value else ["--no-" + flag[2:]]) if isinstance(value, bool) else [flag, str(value)]
    return shlex.join(words)


def _run_distill_topk(args: argparse.Namespace) -> None:
    manifest = annotate_topk(config_from_args(TeacherTopkConfig, args))
    print(f"distill-topk: {manifest['records']} records in {len(manifest['shards'])} shards -> {args.out}")


def _run_init_drafter(args: argparse.Namespace) -> None:
    from specdraft.training.drafter_config import init_drafter

    print(init_drafter(config_from_args(InitDrafterConfig, args), command=command_line(args)), flush=True)


def _run_pretrain(args: argparse.Namespace) -> None:
    skip = ("steps",) if args.tokens is not None else ()  # --tokens sets the steps; the default would mislead
    print(pretrain(config_from_args(PretrainConfig, args), command=command_line(args, skip)), flush=True)


def _run_distill_data(args: argparse.Namespace) -> None:
    manifest = generate_distillation_data(config_from_args(DistillDataConfig, args), overwrite=args.overwrite)
    if manifest:  # under torchrun only rank 0 writes and returns the manifest
        print(json.dumps({k: manifest[k] for k in ("complete", "num_shards", "records")}), flush=True)


def _run_task_prompts(args: argparse.Namespace) -> None:
    from collections import Counter

    from specdraft.training.task_prompts import build_task_prompts, write_task_prompts

    prompts = build_task_prompts(args.per_task, args.seed)
    counts = Counter(p.category for p in prompts)
    print(f"task-prompts: {len(prompts)} prompts ({', '.join(f'{k} {v}' for k, v in counts.items())}) -> "
          f"{write_task_prompts(args.out, prompts)}", flush=True)


def _run_finetune(args: argparse.Namespace) -> None:
    print(finetune(config_from_args(FinetuneConfig, args), command=command_line(args)), flush=True)


def _run_train_heads(args: argparse.Namespace) -> None:
    from specdraft.training.heads import HeadsConfig, train_heads

    print(train_heads(config_from_args(HeadsConfig, args), command=command_line(args)), flush=True)


def _run_train_drafter(args: argparse.Namespace) -> None:
    print(train_drafter(load_pipeline_file(args.config), command=command_line(args), overwrite=args.overwrite),
          flush=True)


def add_training_commands(sub) -> None:
    """Add ``init-drafter``, ``pretrain``, ``distill-data``, ``task-prompts``, ``distill-topk``, ``finetune``,
    ``train-heads`` and ``train-drafter`` to an argparse subparsers object."""
    p = sub.add_parser("pretrain", help="stage 1: pretrain a small drafter on text with the target's tokenizer")
    add_config_arguments(p, PretrainConfig)
    p.set_defaults(run=_run_pretrain, subcommand="pretrain")
    p = sub.add_parser("init-drafter", help="stage 1 alternative: a drafter made of some of the target's layers")
    add_config_arguments(p, InitDrafterConfig)
    p.set_defaults(run=_run_init_drafter, subcommand="init-drafter")
    p = sub.add_parser("distill-data", help="generate the target's responses to prompts (distillation data)")
    add_config_arguments(p, DistillDataConfig)
    p.add_argument("--overwrite", action="store_true", help="discard data made with other settings in --out")
    p.set_defaults(run=_run_distill_data, subcommand="distill-data")
    p = sub.add_parser("task-prompts", help="Spec-Bench-shaped prompts (translation, summarization, qa, "
                                            "math_reasoning, rag) from offline text, for distill-data --prompts")
    p.add_argument("--out", required=True, help="prompt jsonl to write")
    p.add_argument("--per-task", type=int, default=500, help="prompts per task (fewer where the source has fewer)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=_run_task_prompts, subcommand="task-prompts")
    p = sub.add_parser("distill-topk", help="store the target's top-k log-probs for distill-data (teacher pass)")
    add_config_arguments(p, TeacherTopkConfig)
    p.set_defaults(run=_run_distill_topk, subcommand="distill-topk")
    p = sub.add_parser("finetune", help="stage 2: align a pretrained drafter with the target by distillation")
    add_config_arguments(p, FinetuneConfig)
    p.set_defaults(run=_run_finetune, subcommand="finetune")
    _add_train_heads(sub)
    p = sub.add_parser("train-drafter", help="pretrain, distill-data and finetune from one JSON or TOML file")
    p.add_argument("--config", required=True, help="file with sections pretrain, distill_data, finetune")
    p.add_argument("--overwrite", action="store_true", help="rebuild the stages whose settings or inputs changed "
                                                            "(each built beside its old run, swapped in when done)")
    p.set_defaults(run=_run_train_drafter, subcommand="train-drafter")


def _add_train_heads(sub) -> None:
    """``train-heads``: Medusa / EAGLE heads on a frozen target (:mod:`specdraft.training.heads`)."""
    from specdraft.training.heads import HeadsConfig

    p = sub.add_parser("train-heads", help="train self-drafting heads (medusa, eagle, eagle3) on a frozen target")
    add_config_arguments(p, HeadsConfig)
    p.set_defaults(run=_run_train_heads, subcommand="train-heads")


# --- the whole pipeline ----------------------------------------------------------------------------------------------


def load_pipeline_file(path: str | Path) -> dict:
    """The sections of a pipeline file: ``.toml`` (tomllib) or JSON; an optional top-level ``target`` applies to
    every stage."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        spec = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except OSError as exc:
        raise SpecdraftError(f"cannot read pipeline file {path}: {exc.strerror}") from None
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise SpecdraftError(f"malformed pipeline file {path}: {exc}") from None
    if not isinstance(spec, dict):
        raise SpecdraftError(f"{path}: expected a table of sections {', '.join(STAGES)}")
    unknown = sorted(set(spec) - {*STAGES, "target"})
    if unknown or not all(isinstance(spec.get(s, {}), dict) for s in STAGES):
        raise SpecdraftError(f"{path}: unknown key {unknown[0]!r}" if unknown else f"{path}: sections must be tables")
    return spec


def _build(cls: type, section: str, values: dict):
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise SpecdraftError(f"[{section}] has no setting {unknown[0]!r}; known: {', '.join(sorted(names))}")
    try:
        return cls(**values)
    except TypeError as exc:
        raise SpecdraftError(f"[{section}]: {exc}") from None


def pipeline_configs(spec: dict) -> tuple[PretrainConfig, DistillDataConfig, FinetuneConfig]:
    """The three stage configs; finetune's drafter and data default to the outputs of the stages before it."""
    for stage in STAGES:
        if stage not in spec:
            raise SpecdraftError(f"pipeline file lacks the [{stage}] section")
    shared = {"target": spec["target"]} if "target" in spec else {}
    pre = _build(PretrainConfig, "pretrain", shared | spec["pretrain"])
    data = _build(DistillDataConfig, "distill_data", shared | spec["distill_data"])
    defaults = {"drafter": str(export_path(pre.out)), "data": data.out}
    fine = _build(FinetuneConfig, "finetune", shared | defaults | spec["finetune"])
    return pre, data, fine


def train_drafter(spec: dict, command: str | None = None, overwrite: bool = False) -> Path:
    """Run pretrain -> distill-data -> finetune; returns the fine-tuned drafter's folder. Every config is validated
    before any stage starts.

    A stage whose folder holds a run of the same settings and inputs is continued, or reused when finished (its
    shards or export checked first); a stage whose settings or inputs changed (a later stage's inputs include the
    earlier stages' outputs) is refused naming what changed, or with ``overwrite`` rebuilt beside the old run and
    swapped in."""
    pre, data, fine = pipeline_configs(spec)
    _training_stage("pretrain", pretrain, pre, lambda: source_inputs(pre), overwrite, command)
    with _section("distill_data"):
        data_overwrite = overwrite and bool(distill_changes(data))
        generate_distillation_data(data, overwrite=data_overwrite, progress=fine.progress)
    _training_stage("finetune", finetune, fine,
                    lambda: data_inputs(data_folders(fine.data), drafter=fine.drafter), overwrite, command)
    return export_path(fine.out)


@contextlib.contextmanager
def _section(name: str):
    """Name the pipeline file's section in a stage's error."""
    try:
        yield
    except SpecdraftError as exc:
        raise SpecdraftError(f"[{name}] {exc}") from None


def _training_stage(name: str, run, config, inputs, overwrite: bool, command: str | None) -> None:
    """Run one training stage of the pipeline: fresh, continued, reused, or (``overwrite``, when its settings or
    inputs changed) replaced."""
    from specdraft.hardware import resolve_bf16, resolve_device
    from specdraft.training.runs import stage_changes

    with _section(name):
        held = Path(config.out).exists()
        if held and overwrite:
            try:
                device = resolve_device(config.device).device
            except ValueError as exc:
                raise SpecdraftError(str(exc)) from None
            resolved = replace(config, bf16=resolve_bf16(config.bf16, device).bf16)
            if hasattr(resolved, "with_budget"):
                resolved = resolved.with_budget(int(os.environ.get("WORLD_SIZE", 1)))
            defaults = {f.name: f.default for f in fields(config) if f.default is not MISSING}
            changed = stage_changes(resolved, inputs(), export_path("").name, defaults)
            if changed:
                run(replace(config, resume=False, overwrite=True), command=command)
                return
        resume = stage_changes(config, {}, export_path("").name, {}) is not None
        run(replace(config, resume=resume, overwrite=False), command=command)
