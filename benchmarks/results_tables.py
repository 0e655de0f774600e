"""Rebuild the tables of docs/results.md from the run folders that produced them.

    .venv/bin/python benchmarks/results_tables.py --report RUNS [--replay] [--only NAME]
    .venv/bin/python benchmarks/results_tables.py RUN [RUN ...] [--metric block_efficiency|speedup|...]

``--report RUNS``: every table of docs/results.md, in the report's order, from the folders under RUNS named in the
report's "Reproduce" section (``specdraft bench`` folders: summary.json; training folders: eval_log.csv). A folder
that is missing is reported and skipped. ``--replay`` also recomputes the same-text τ tables by greedy replay
(:mod:`specdraft.bench.replay`; loads the target and drafters, minutes on a CPU). ``--only NAME`` prints one table.

Without ``--report``: for each bench run given, a table of one metric by subtask (τ by default) for every method.
Numbers come from the run folders only.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from specdraft.bench.questions import SUBTASKS

METRICS = {"block_efficiency": ("τ", 2), "mbsu": ("MBSU", 2), "speedup": ("speed-up", 2),
           "decode_speedup": ("decode-only speed-up", 2), "tokens_per_second": ("tokens/s", 1),
           "acceptance_rate": ("acceptance", 2)}

DRAFTER = "smollm2-135m-instruct-drafter"
EAGLE = "smollm2-135m-instruct-eagle"
S6 = "ft-l01-tasks/model"  # the shipped drafter's weights, as a run folder
DEF = "confidence_threshold=0.3;prompt_lookup=3;prompt_lookup_alone=3"  # the options these tables were measured with


def _fmt(value, digits: int, suffix: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


# --- columns of a method's overall metrics (summary.json's "overall" M) --------------------------------------------


def _positions(m: dict) -> str:
    rates = m.get("acceptance_rate_per_position")
    return "–" if not rates else ", ".join(f"{r:.2f}" for r in rates[:4])


def _equal(m: dict) -> str:
    answers = m.get("greedy_equal_answers")
    return "–" if not answers or not answers.get("compared") else f"{answers['equal']}/{answers['compared']}"


COLUMNS: dict[str, tuple[str, Callable[[dict], str]]] = {
    "tau": ("τ", lambda m: _fmt(m.get("block_efficiency"), 2)),
    "positions": ("acceptance, positions 1-4", _positions),
    "tps": ("tokens/s", lambda m: _fmt(m.get("tokens_per_second"), 1)),
    "speedup": ("speed-up", lambda m: _fmt(m.get("speedup"), 2, "x")),
    "decode": ("decode-only speed-up", lambda m: _fmt(m.get("decode_speedup"), 2, "x")),
    "equal": ("answers equal to `ar`", _equal),
}


@dataclass(frozen=True)
class BenchTable:
    """Rows = methods of one bench run (``methods``: name in summary.json -> label, in order); columns = overall
    metrics (``columns``), or, with ``by_subtask``, that metric per subtask and overall."""

    name: str
    run: str
    methods: dict[str, str]
    columns: tuple[str, ...] = ("tau", "positions", "tps", "speedup", "decode", "equal")
    by_subtask: str | None = None


@dataclass(frozen=True)
class TrainTable:
    """Rows = training runs (``runs``: folder -> label); columns = metrics of the last (or ``step``'s) row of each
    run's eval_log.csv."""

    name: str
    runs: dict[str, str]
    columns: dict[str, str]
    step: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ReplayTable:
    """Same-text τ by subtask: greedy replay of ``methods`` (spec -> label) over a float32 run's ``ar`` answers."""

    name: str
    run: str
    methods: dict[str, str]
    num_draft_tokens: int | None = None


def _shipped(label: str = "shipped drafter, default options") -> dict[str, str]:
    return {f"draft:{DRAFTER}": label}


LOSSES = {"draft:init-l01": "pretrained only (the untrained copy of layers 0-1)",
          "draft:loss-l01-fkl/model": "forward KL", "draft:loss-l01-rkl/model": "reverse KL",
          "draft:loss-l01-tvd/model": "TVD", "draft:loss-l01-tvdpp/model": "TVD++",
          "draft:ft-l01-fkl/model": "forward KL, 2,000 steps (the shipped drafter's first stage c)",
          f"draft:{S6}": "the shipped drafter's model (+ task data, 1,200 steps)"}
LENGTH = {"ar": "`ar`"} | _shipped() | {"prompt-lookup": "prompt lookup alone"}
EAGLE_ROWS = {f"eagle:heads=heads-eagle/heads;top_k={k};tree_nodes={n}{v}": f"EAGLE k {k}, {n} nodes{label}"
              for k, n, v, label in ((1, 4, ";draft_vocab=8192", " (chain)"), (2, 4, ";draft_vocab=8192", ""),
                                     (4, 8, ";draft_vocab=8192", ""), (4, 16, ";draft_vocab=8192", ""),
                                     (2, 4, "", ", full vocabulary"))}
MEDUSA_ROWS = {f"medusa:heads=heads-medusa/heads;tree_nodes={n};top_k=4;draft_vocab=8192": f"Medusa dynamic, {n} nodes"
               for n in (4, 8, 16)} | {"medusa:heads=heads-medusa/heads": "Medusa static 16-node tree, full vocabulary"}

REPORT: list[BenchTable | TrainTable | ReplayTable] = [
    TrainTable("shipped-drafter-heldout", {"ft-l01-fkl": "stage (c), ShareGPT answers", "ft-l01-tasks":
                                           "stage (c), pooled (the shipped drafter)"},
               {"heldout_tvd": "held-out TVD", "heldout_coverage": "draft-vocabulary coverage",
                "block_efficiency@3": "τ@3", "block_efficiency@5": "τ@5"}),
    TrainTable("heads-heldout", {"heads-eagle": "EAGLE", "heads-medusa": "Medusa-1, 4 heads",
                                 "heads-medusa-distill": "Medusa, self-distillation"},
               {"heldout_top1": "EAGLE top-1", "head1_top1": "Medusa head-1 top-1", "head2_top1": "head-2 top-1",
                "block_efficiency@4": "τ@4"}),
    TrainTable("loss-heldout", {f"loss-l01-{loss}": label for loss, label in (
        ("fkl", "forward KL"), ("tvdpp", "TVD++"), ("tvd", "TVD"), ("rkl", "reverse KL"))},
               {"heldout_tvd": "held-out TVD", "block_efficiency@3": "τ@3", "block_efficiency@5": "τ@5"}),
    ReplayTable("loss-replay-3", "bench7-fp32", LOSSES, num_draft_tokens=3),
    ReplayTable("loss-replay-5", "bench7-fp32", LOSSES, num_draft_tokens=5),
    TrainTable("three-layers-heldout", {"ft-l01-tasks": "layers 0-1 (shipped)", "ft-l012-tasks": "layers 0-2"},
               {"heldout_tvd": "held-out TVD", "block_efficiency@3": "τ@3", "block_efficiency@5": "τ@5"}),
    ReplayTable("three-layers-replay", "bench7-fp32", _shipped("layers 0-1 (shipped)") | {
        f"draft:ft-l012-tasks/model;{DEF}": "layers 0-2, same options", "draft:ft-l012-tasks/model":
        "layers 0-2, the model alone"}),
    BenchTable("three-layers-bench", "bench7-l012", {"ar": "`ar`"} | _shipped("layers 0-1 (shipped)") | {
        f"draft:ft-l012-tasks/model;{DEF}": "layers 0-2, same options"}, ("tau", "tps", "speedup")),
    BenchTable("specbench-1024-bf16", "bench9-1024", {"ar": "`ar` (plain decoding)"} | _shipped() | {
        "prompt-lookup": "prompt lookup alone",
        f"hf-assisted:{DRAFTER}": "transformers assisted generation, same drafter, γ = 4"}),
    BenchTable("specbench-1024-fp32", "bench9-fp32-1024", {"ar": "`ar`"} | _shipped() | {
        "prompt-lookup": "prompt lookup alone"}),
    ReplayTable("specbench-1024-replay", "bench9-fp32-1024", _shipped() | {
        f"draft:{DRAFTER};prompt_lookup=0;prompt_lookup_alone=0": "the model alone", "prompt-lookup":
        "prompt lookup alone"}),
    BenchTable("length-64", "bench7-main", LENGTH | {
        f"hf-assisted:{S6}": "transformers assisted, same drafter", f"eagle:heads={EAGLE}": "EAGLE head (shipped)",
        "lookahead": "Lookahead"}, ("tau", "tps", "speedup", "decode")),
    BenchTable("length-256", "bench7-256", LENGTH, ("tau", "tps", "speedup", "decode")),
    BenchTable("length-1024", "bench7-1024", LENGTH, ("tau", "tps", "speedup", "decode")),
    BenchTable("sharegpt", "bench6-sharegpt", {"ar": "`ar`", f"draft:{S6};confidence_threshold=0.3":
                                               "shipped drafter, confidence stop only", f"draft:{S6};{DEF}":
                                               "shipped drafter, default options",
                                               f"hf-assisted:{S6}": "transformers assisted, same drafter"},
               ("tau", "tps", "speedup", "positions")),
    BenchTable("options", "bench6-opts", {
        "ar": "`ar`", f"draft:{S6};confidence_threshold=0.3": "confidence 0.3",
        f"draft:{S6};confidence_threshold=0.3;prompt_lookup=3": "confidence 0.3, `prompt_lookup=3`",
        f"draft:{S6};{DEF}": "defaults", f"draft:{S6};confidence_threshold=0.3;prompt_lookup=3;prompt_lookup_alone=2":
        "confidence 0.3, `prompt_lookup=3`, `prompt_lookup_alone=2`", "prompt-lookup": "prompt lookup alone"},
               ("tau", "speedup", "positions")),
    BenchTable("siblings", "bench7-sib3", {"ar": "`ar`", f"draft:{S6};{DEF}": "DEF",
                                           f"draft:{S6};{DEF};siblings=1": "DEF + `siblings=1`",
                                           f"draft:{S6};{DEF};siblings=2": "DEF + `siblings=2`",
                                           "prompt-lookup": "prompt lookup alone"}, ("tau", "speedup", "decode")),
    BenchTable("confidence", "bench7-conf", {"ar": "`ar`"} | {
        f"draft:{S6};confidence_threshold={t};prompt_lookup=3;prompt_lookup_alone=3": f"threshold {t}"
        for t in ("0.2", "0.3", "0.45", "0.6")} | {
        f"draft:{S6};confidence_threshold=0.45;prompt_lookup=3;prompt_lookup_alone=3;siblings=1":
        "threshold 0.45 + `siblings=1`"}, ("tau", "speedup")),
    BenchTable("temperature-1", "bench6-t1", {f"draft:{S6};confidence_threshold=0@γ={g}": f"γ = {g}"
                                              for g in (3, 5)}, ("tau",)),
    BenchTable("training-free", "quiet", {"ar": "`ar`", "prompt-lookup": "prompt lookup", "rest": "REST",
                                          "lookahead": "Lookahead", "layer-skip:skip_ratio=0.3": "layer-skip"},
               by_subtask="block_efficiency"),
    BenchTable("heads", "heads", {"ar": "`ar`", "prompt-lookup": "prompt lookup"} | EAGLE_ROWS | MEDUSA_ROWS,
               ("tau", "tps", "speedup", "positions")),
    BenchTable("medusa2", "medusa2", {"ar": "`ar`", f"{next(iter(MEDUSA_ROWS))}": "hard labels, 4 nodes"} | {
        f"medusa:heads=heads-medusa-distill/heads;tree_nodes={n};top_k=4;draft_vocab=8192":
        f"self-distilled, {n} nodes" for n in (4, 8)}, ("tau", "speedup")),
    *(BenchTable(f"equality-{run}", run, methods, ("tau", "equal")) for run, methods in (
        ("bench9-fp32-1024", _shipped() | {"prompt-lookup": "prompt lookup"}),
        ("bench7-fp32-256", _shipped()),
        ("bench7-fp32", _shipped() | {f"draft:{S6};{DEF};siblings=2": "DEF + `siblings=2`", "lookahead": "Lookahead",
                                      f"eagle:heads={EAGLE}": "EAGLE head (shipped)"}),
        ("fp32", {f"draft:{DRAFTER}": "draft model, chain", f"draft:{DRAFTER};tree_branching=2;tree_nodes=8":
                  "draft model, dynamic tree", "rest": "REST", "lookahead": "Lookahead"}),
        ("heads-fp32", {k: v for k, v in (EAGLE_ROWS | MEDUSA_ROWS).items()
                        if "draft_vocab" in k and ("nodes=4" in k or "nodes=8" in k) and "top_k=1" not in k
                        and not ("medusa" in k and "nodes=8" in k)}),
    )),
]


# --- building the tables -------------------------------------------------------------------------------------------


def _markdown(head: list[str], rows: list[list[str]]) -> str:
    lines = [f"| {' | '.join(head)} |", "|" + "---|" * len(head)]
    return "\n".join([*lines, *(f"| {' | '.join(row)} |" for row in rows)])


def _missing(what: str) -> str:
    return f"(missing: {what})"


def bench_table(spec: BenchTable, runs: Path) -> str:
    path = runs / spec.run / "summary.json"
    if not path.is_file():
        return _missing(path)
    methods = json.loads(path.read_text())["methods"]
    present = {name: label for name, label in spec.methods.items() if name in methods}
    absent = [name for name in spec.methods if name not in methods]
    if spec.by_subtask:
        subtasks = [s for s in SUBTASKS if any(s in methods[n]["subtasks"] for n in present)]
        label, digits = METRICS[spec.by_subtask]
        rows = [[lab, *(_fmt(methods[n]["subtasks"].get(s, {}).get(spec.by_subtask), digits) for s in subtasks),
                 _fmt(methods[n]["overall"].get(spec.by_subtask), digits)] for n, lab in present.items()]
        text = f"{label} by subtask\n\n" + _markdown(["method", *subtasks, "overall"], rows)
    else:
        rows = [[lab, *(COLUMNS[c][1](methods[n]["overall"]) for c in spec.columns)] for n, lab in present.items()]
        text = _markdown(["method", *(COLUMNS[c][0] for c in spec.columns)], rows)
    return text + ("\n\n" + _missing(", ".join(absent)) if absent else "")


def last_eval(path: Path, step: int | None = None) -> dict[str, str] | None:
    """The last row (or the row of ``step``) of an eval_log.csv, or None when the file is missing."""
    if not path.is_file():
        return None
    with path.open(newline="") as file:
        rows = list(csv.DictReader(file))
    if step is not None:
        rows = [row for row in rows if int(row["step"]) == step]
    return rows[-1] if rows else None


def train_table(spec: TrainTable, runs: Path) -> str:
    rows = []
    for folder, label in spec.runs.items():
        row = last_eval(runs / folder / "eval_log.csv", spec.step.get(folder))
        if row is None:
            rows.append([label, _missing(folder), *(["–"] * len(spec.columns))])
            continue
        cells = [f"{float(row[key]):.3f}" if row.get(key) not in (None, "") else "–" for key in spec.columns]
        rows.append([label, row["step"], *cells])
    return _markdown(["run", "step", *spec.columns.values()], rows)


def replay_table(spec: ReplayTable, runs: Path) -> str:
    from replay_tau import replay_methods  # benchmarks/replay_tau.py, beside this file

    run = runs / spec.run
    if not (run / "answers" / "ar.jsonl").is_file():
        return _missing(run / "answers" / "ar.jsonl")
    results = replay_methods(run, list(spec.methods), spec.num_draft_tokens)
    subtasks = [s for s in SUBTASKS if any(s in taus for taus in results.values())]
    rows = [[spec.methods[name], *(_fmt(taus.get(s), 2) for s in subtasks), _fmt(taus["overall"], 2)]
            for name, taus in results.items()]
    return _markdown(["drafter", *subtasks, "overall"], rows)


def report(runs: Path, replay: bool, only: str | None) -> str:
    """Every table of the report (or only the one named ``only``) as markdown, each under a heading with its name."""
    if only is not None and only not in {spec.name for spec in REPORT}:
        raise ValueError(f"no table named {only!r}")
    parts = []
    for spec in REPORT:
        if only and spec.name != only:
            continue
        if isinstance(spec, ReplayTable):
            body = replay_table(spec, runs) if replay else "(greedy replay: rerun with --replay)"
            source = spec.run
        elif isinstance(spec, BenchTable):
            body, source = bench_table(spec, runs), spec.run
        else:
            body, source = train_table(spec, runs), ", ".join(spec.runs)
        parts.append(f"### {spec.name} ({source})\n\n{body}")
    return "\n\n".join(parts) + "\n"


def subtask_table(summary: dict, metric: str, rename: dict[str, str]) -> str:
    """One bench run: methods x (subtasks, overall) of ``metric``, under a line naming the run's setup."""
    label, digits = METRICS[metric]
    methods = summary["methods"]
    subtasks = [s for s in SUBTASKS if any(s in m["subtasks"] for m in methods.values())]
    rows = [[rename.get(name, name), *(_fmt(m["subtasks"].get(s, {}).get(metric), digits) for s in subtasks),
             _fmt(m["overall"].get(metric), digits)] for name, m in methods.items()]
    setup = summary["setup"]
    sampling = "greedy" if setup["sampling"]["greedy"] else f"temperature {setup['sampling']['temperature']}"
    note = (f"{label}; {setup['dtype']}, {sampling}, max_new_tokens {setup['max_new_tokens']}, "
            f"questions {Path(str(setup['questions'])).name}, per category {setup['per_category']}, "
            f"n = {methods['ar']['overall']['n']} answers per method")
    return note + "\n\n" + _markdown(["method", *subtasks, "overall"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", help="bench run folders (without --report)")
    parser.add_argument("--report", type=Path, help="the folder holding every run folder of docs/results.md")
    parser.add_argument("--replay", action="store_true", help="with --report: recompute the replay tables")
    parser.add_argument("--only", choices=[spec.name for spec in REPORT], help="with --report: one table")
    parser.add_argument("--metric", default="block_efficiency", choices=sorted(METRICS))
    parser.add_argument("--rename", action="append", default=[],
                        help="OLD=>NEW method display name (method names may hold '=')")
    args = parser.parse_args()
    if args.only and not args.report:
        parser.error("--only needs --report")
    if args.report:
        print(report(args.report, args.replay, args.only), end="")
        return
    if not args.runs:
        parser.error("give bench run folders, or --report RUNS")
    rename = dict(item.split("=>", 1) for item in args.rename)
    for run in args.runs:
        print(subtask_table(json.loads((Path(run) / "summary.json").read_text()), args.metric, rename), end="\n\n")


if __name__ == "__main__":
    main()
