"""Markdown tables for docs/results.md from one or more ``specdraft bench`` output folders.

    .venv/bin/python benchmarks/results_tables.py RUN_DIR [RUN_DIR ...] [--metric block_efficiency|mbsu|speedup]
        [--rename 'OLD=>NEW' ...]

For each run: a table with one row per method and one column per subtask plus overall, holding the chosen metric
(τ by default), and the run's setup line. Numbers come from each run's summary.json only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdraft.bench.questions import SUBTASKS

METRICS = {"block_efficiency": ("τ", 2), "mbsu": ("MBSU", 2), "speedup": ("speed-up", 2),
           "tokens_per_second": ("tokens/s", 1), "acceptance_rate": ("acceptance", 2)}


def _fmt(value, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def table(summary: dict, metric: str, rename: dict[str, str]) -> str:
    """One markdown table: methods x (subtasks, overall) of ``metric``."""
    label, digits = METRICS[metric]
    methods = summary["methods"]
    subtasks = [s for s in SUBTASKS if any(s in m["subtasks"] for m in methods.values())]
    head = f"| method | {' | '.join(subtasks)} | overall |"
    rows = [head, "|" + "---|" * (len(subtasks) + 2)]
    for name, m in methods.items():
        cells = [_fmt(m["subtasks"].get(s, {}).get(metric), digits) for s in subtasks]
        rows.append(f"| {rename.get(name, name)} | {' | '.join(cells)} | {_fmt(m['overall'].get(metric), digits)} |")
    setup = summary["setup"]
    sampling = "greedy" if setup["sampling"]["greedy"] else f"temperature {setup['sampling']['temperature']}"
    note = (f"{label}; {setup['dtype']}, {sampling}, max_new_tokens {setup['max_new_tokens']}, "
            f"questions {Path(str(setup['questions'])).name}, per category {setup['per_category']}, "
            f"n = {methods['ar']['overall']['n']} answers per method")
    return note + "\n\n" + "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--metric", default="block_efficiency", choices=sorted(METRICS))
    parser.add_argument("--rename", action="append", default=[],
                        help="OLD=>NEW method display name (method names may hold '=')")
    args = parser.parse_args()
    rename = dict(item.split("=>", 1) for item in args.rename)
    for run in args.runs:
        print(table(json.loads((Path(run) / "summary.json").read_text()), args.metric, rename), end="\n\n")


if __name__ == "__main__":
    main()
