"""The draft-training subcommands of ``specdraft`` (Goel et al. 2024, arXiv 2403.00858): ``pretrain``,
``distill-data``, ``finetune``, and ``train-drafter`` that runs a whole recipe from one JSON or TOML file
(:mod:`specdraft.training.recipe`).

Each subcommand's flags are generated from its config dataclass (one flag per field, its help text from the
field's metadata, ``--x/--no-x`` for booleans), so the CLI and the library cannot drift apart. A handler builds
the config (whose validation raises :class:`SpecdraftError`, which the CLI turns into exit code 2) and calls one
library function. Register them with :func:`add_training_commands`.
"""

from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import MISSING, fields

from specdraft.training.data.distill_data import DistillDataConfig, generate_distillation_data
from specdraft.training.data.distill_topk import TeacherTopkConfig, annotate_topk
from specdraft.training.data.task_prompts import build_task_prompts, write_task_prompts
from specdraft.training.drafter.finetune import FinetuneConfig, finetune
from specdraft.training.drafter.init_drafter import InitDrafterConfig, init_drafter
from specdraft.training.drafter.pretrain import PretrainConfig, pretrain
from specdraft.training.heads.train_heads import HeadsConfig, train_heads
from specdraft.training.recipe import load_pipeline_file, train_drafter

_TYPES = {"int": int, "float": float, "str": str, "int | None": int, "float | None": float, "str | None": str}


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

    prompts = build_task_prompts(args.per_task, args.seed)
    counts = Counter(p.category for p in prompts)
    print(f"task-prompts: {len(prompts)} prompts ({', '.join(f'{k} {v}' for k, v in counts.items())}) -> "
          f"{write_task_prompts(args.out, prompts)}", flush=True)


def _run_finetune(args: argparse.Namespace) -> None:
    print(finetune(config_from_args(FinetuneConfig, args), command=command_line(args)), flush=True)


def _run_train_heads(args: argparse.Namespace) -> None:
    print(train_heads(config_from_args(HeadsConfig, args), command=command_line(args)), flush=True)


def _run_train_drafter(args: argparse.Namespace) -> None:
    only = tuple(part.strip() for part in (args.stages or "").split(",") if part.strip())
    exports = train_drafter(load_pipeline_file(args.config), command=command_line(args), overwrite=args.overwrite,
                            only=only)
    print(exports["drafter"], flush=True)
    if "heads" in exports:
        print(exports["heads"], flush=True)


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
    p = sub.add_parser("train-drafter", help="the whole recipe from one TOML or JSON file: data, drafter, "
                                             "distillation phases, heads")
    p.add_argument("--config", required=True, help="file with sections distill_data, heldout_data, pretrain or "
                                                   "init_drafter, finetune (one or several phases), heads")
    p.add_argument("--overwrite", action="store_true", help="rebuild the stages whose settings or inputs changed "
                                                            "(each built beside its old run, swapped in when done)")
    p.add_argument("--stages", help="run only these sections, comma-separated (the others' outputs are still "
                                    "their inputs)")
    p.set_defaults(run=_run_train_drafter, subcommand="train-drafter")


def _add_train_heads(sub) -> None:
    """``train-heads``: Medusa / EAGLE heads on a frozen target (:mod:`specdraft.training.heads.train_heads`)."""
    p = sub.add_parser("train-heads", help="train self-drafting heads (medusa, eagle, eagle3) on a frozen target")
    add_config_arguments(p, HeadsConfig)
    p.set_defaults(run=_run_train_heads, subcommand="train-heads")
