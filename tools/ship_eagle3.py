"""Ship EAGLE-3 heads as the package's ``smollm2-135m-instruct-eagle3`` (``src/specdraft/weights/<name>``).

    python tools/ship_eagle3.py HEADS [--results TAU.jsonl] [--options 'top_k=2;tree_nodes=4'] [--out FOLDER]

HEADS is a heads folder made by ``specdraft train-heads --kind eagle3`` (``RUN/heads``) for SmolLM2-135M-Instruct;
heads of another kind, another target or other shapes are refused. The new folder is built beside the shipped one
and renamed over it (:func:`specdraft.files.build_folder`): ``heads.safetensors`` (floating weights in bf16; ``d2t``
and ``t2d`` exact), ``heads.json``, ``drafter_options.json`` (``--options``, else the shipped ones) and ``README.md``.

The model card is the shipped one with two generated parts rewritten:
- between ``<!-- training:begin -->`` and ``<!-- training:end -->``: the training stages, followed back through
  ``init_heads`` (each run's ``train_log.csv``, ``eval_log.csv``, and ``run.json`` or its heads' card): steps,
  response tokens, wall time, and the last stage's held-out metrics;
- between ``<!-- results:begin -->`` and ``<!-- results:end -->``: the JSON rows printed by
  ``benchmarks/eagle3_tau.py`` (``--results``) as a table; without ``--results`` the old table stays only while the
  weights are unchanged, else the card says the new weights are not measured yet.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import re
import sys
from pathlib import Path

import torch

from specdraft.drafters.options import DRAFTER_OPTIONS_FILE, folder_options, parse_options
from specdraft.errors import SpecdraftError
from specdraft.files import build_folder
from specdraft.heads import WEIGHTS_FILE, load_heads, write_heads
from specdraft.heads.eagle import head_config
from specdraft.models.registry import SHIPPED_HEADS, SMOLLM2, SMOLLM2_EAGLE3, names_builtin, resolve_heads

MAX_BYTES = 40 * 2**20
DEFAULT_OPTIONS = {"top_k": 2, "tree_nodes": 4}
MARKERS = ("training", "results")
NOT_MEASURED = ("Not measured for these weights yet: run `benchmarks/eagle3_tau.py` and ship again with `--results` "
                "(docs/eagle3.md, \"Shipped head\").")


def check_heads(heads: Path, target_config) -> tuple[dict, torch.nn.Module]:
    """The EAGLE-3 heads in ``heads`` if they were trained for SmolLM2-135M-Instruct and have its shapes."""
    meta, head = load_heads(heads, kind="eagle3")
    if not names_builtin(str(meta.get("target", "")), SMOLLM2):
        raise SpecdraftError(f"{heads} are heads for target {meta.get('target')!r}, not {SMOLLM2}")
    expected = head_config(target_config)
    wrong = [f"{key} {head.sizes.get(key)} (target: {value})" for key, value in expected.items()
             if head.sizes.get(key) != value]
    if wrong or max(head.aux_layers) >= target_config.num_hidden_layers:
        raise SpecdraftError(f"{heads} do not fit {SMOLLM2}: {', '.join(wrong) or ''} aux layers {head.aux_layers} "
                             f"of {target_config.num_hidden_layers}")
    return meta, head


def _last_row(path: Path) -> dict | None:
    if not path.is_file():
        return None
    with path.open(newline="") as file:
        rows = list(csv.DictReader(file))
    return rows[-1] if rows else None


def _settings(run: Path, heads: Path) -> dict:
    """A run's settings: ``run.json``, else the JSON block of its heads' model card."""
    if (run / "run.json").is_file():
        return json.loads((run / "run.json").read_text()).get("settings", {})
    card = (heads / "README.md").read_text() if (heads / "README.md").is_file() else ""
    block = re.search(r"```json\n(.*?)\n```", card, re.S)
    return json.loads(block.group(1)) if block else {}


def training_stages(heads: Path) -> list[dict]:
    """The training runs that made ``heads``, first run first, each with its settings, the last row of its
    ``train_log.csv`` and ``eval_log.csv`` and the held-out count of its heads' card; a stage whose run is not
    found is ``{"missing": True}``."""
    stages, folder, seen = [], heads, set()
    while folder is not None and folder.resolve() not in seen:
        seen.add(folder.resolve())
        run = folder.parent
        train = _last_row(run / "train_log.csv")
        if train is None:
            stages.append({"missing": True})
            break
        card = (folder / "README.md").read_text() if (folder / "README.md").is_file() else ""
        heldout = re.search(r"(\d+) held out", card)
        settings = _settings(run, folder)
        stages.append({"settings": settings, "train": train, "eval": _last_row(run / "eval_log.csv"),
                       "heldout": int(heldout.group(1)) if heldout else None})
        folder = Path(settings["init_heads"]) if settings.get("init_heads") else None
    return stages[::-1]


def training_table(stages: list[dict]) -> str:
    """The training part of the card: one row per stage, the totals, the last stage's held-out metrics."""
    lines = ["| stage | starts from | steps | batch | peak lr | loss | response tokens | wall time |",
             "|---|---|---|---|---|---|---|---|"]
    known = [s for s in stages if not s.get("missing")]
    if len(known) < len(stages):
        lines.insert(0, "Earlier training of these heads is not recorded here.\n")
    for number, stage in enumerate(known, start=1):
        settings, train = stage["settings"], stage["train"]
        first = "a fresh head" if len(known) == len(stages) else "earlier heads"
        start = f"stage {number - 1}" if number > 1 else first
        loss = parse_options(settings.get("options", "")).get("loss", "?")
        lines.append(f"| {number} | {start} | {int(train['step']):,} | {settings.get('batch_size', '?')} | "
                     f"{settings.get('lr', '?')} | {loss} | {int(train['tokens']):,} | "
                     f"{float(train['wall_s']) / 3600:.1f} h |")
    steps = sum(int(s["train"]["step"]) for s in known)
    tokens = sum(int(s["train"]["tokens"]) for s in known)
    hours = sum(float(s["train"]["wall_s"]) for s in known) / 3600
    lines.append(f"| all | | {steps:,} | | | | {tokens:,} | {hours:.1f} h |")
    last = known[-1] if known else {}
    lines += ["", f"Options of the last stage: `{last.get('settings', {}).get('options', '?')}`."]
    ev = last.get("eval")
    if ev:
        top1 = ", ".join(f"{float(ev[f'heldout_top1_step{i}']):.3f}" for i in range(4) if f"heldout_top1_step{i}" in ev)
        lines += ["", f"Held out ({last.get('heldout') or '?'} records, at the last stage's step {ev['step']}): "
                      f"top-1 agreement of draft steps 0-3 with the target's greedy token {top1}; greedy chain τ "
                      f"replayed at γ 3 {float(ev['greedy_tau@3']):.2f}; τ decoded with a 16-node tree of depth 4 on 4 "
                      f"held-out prompts, 32 tokens, fp32: {float(ev['block_efficiency@4']):.2f}."]
    return "\n".join(lines)


def _options(row: dict, defaults: dict) -> str:
    """The options a row's drafter ran with: those given over the defaults of the heads folder it names, or for
    eagle3 without heads=, over the shipped head's ``defaults``."""
    given = parse_options(row["options"])
    if "heads" in given:
        base = folder_options(resolve_heads(given["heads"]))
    else:
        base = {key: str(value) for key, value in defaults.items()} if row["drafter"] == "eagle3" else {}
    return ";".join(f"{key}={value}" for key, value in (base | given).items()) or "(defaults)"


def results_table(rows: list[dict], defaults: dict) -> str:
    """The results part of the card from ``benchmarks/eagle3_tau.py``'s JSON rows (one run, methods interleaved);
    ``defaults``: the shipped drafter options, which eagle3 rows without heads= ran with."""
    first = rows[0]
    threads = f"{first['threads']} torch thread{'s' if first['threads'] != 1 else ''}"
    fixed = first.get("speculation", "adaptive") == "fixed"
    speculation = "the same depth every step" if fixed else "adaptive speculation (the depth is a maximum)"
    lines = [f"{first['prompts']} Spec-Bench questions (`{first['questions']}`, the first turn of the first "
             f"{first['per_category']} of each subtask), {first['dtype']}, greedy, {first['max_new_tokens']} new "
             f"tokens, batch 1, {speculation}; a {first['cores']}-core {first['cpu']} CPU (torch kernels "
             f"{first['cpu_capability']}, "
             f"bf16 {'native' if first['bf16_native'] else 'emulated'}), {threads}, shared with "
             f"other jobs (load average {first['load_avg'][0]} at the start, {first['load_avg'][1]} at the end: "
             f"speed-ups jitter 20-30%); measured {first['date']}.",
             "",
             "| method | drafter | depth (γ) | options | τ | first draft token accepted | draft tokens accepted | "
             "speed-up over plain decoding | equal to plain decoding |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['method']} | {row['drafter']} | {row['num_draft_tokens']} | "
                     f"`{_options(row, defaults)}` | {row['tau']:.2f} | {row['first_token_acceptance']:.2f} | "
                     f"{row['acceptance']:.2f} | {row['speedup']:.2f}x | {row['equal_to_plain']} |")
    return "\n".join(lines)


def read_results(path: Path) -> list[dict]:
    """The JSON rows of ``benchmarks/eagle3_tau.py``'s output (its per-question lines are skipped)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    if not rows:
        raise SpecdraftError(f"{path} holds no result rows of benchmarks/eagle3_tau.py")
    return rows


def fill_card(card: str, parts: dict[str, str]) -> str:
    """``card`` with the text between each ``<!-- NAME:begin -->`` / ``<!-- NAME:end -->`` pair of ``parts``
    replaced."""
    for name, text in parts.items():
        pattern = re.compile(rf"(<!-- {name}:begin -->\n)(?:.*?\n)?(<!-- {name}:end -->)", re.S)
        if not pattern.search(card):
            raise SpecdraftError(f"the model card lacks the markers <!-- {name}:begin --> ... <!-- {name}:end -->")
        card = pattern.sub(lambda m, text=text: f"{m.group(1)}{text.strip()}\n{m.group(2)}", card)
    return card


def check_options(options: dict[str, str]) -> dict[str, int | str]:
    """Default drafter options that ``--drafter eagle3`` takes (numbers as JSON numbers)."""
    import inspect

    from specdraft.drafters.eagle3 import Eagle3Drafter

    known = set(inspect.signature(Eagle3Drafter.__init__).parameters) - {"self", "heads"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise SpecdraftError(f"unknown eagle3 option {', '.join(unknown)}; eagle3 takes: {', '.join(sorted(known))}")
    return {key: int(value) if value.isdigit() else value for key, value in options.items()}


def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def ship(heads: Path, out: Path, target_config, results: list[dict] | None = None,
         options: dict[str, int | str] | None = None) -> Path:
    """Build the shipped folder ``out`` from ``heads`` (see the module docstring); returns ``out``."""
    meta, head = check_heads(heads, target_config)
    if not (out / "README.md").is_file():
        raise SpecdraftError(f"no model card at {out / 'README.md'} to fill in")
    card, old_digest = (out / "README.md").read_text(), _digest(out / WEIGHTS_FILE)
    if options is None:
        old = out / DRAFTER_OPTIONS_FILE
        options = json.loads(old.read_text()) if old.is_file() else DEFAULT_OPTIONS

    def fill(tmp: Path) -> None:
        write_heads(tmp, head, "eagle3", meta["spec"], SMOLLM2, "", torch.bfloat16)
        size = (tmp / WEIGHTS_FILE).stat().st_size
        if size > MAX_BYTES:
            raise SpecdraftError(f"{heads} make {size / 2**20:.1f} MiB of bf16 weights; the package takes "
                                 f"{MAX_BYTES / 2**20:.0f} MiB at most")
        parts = {"training": training_table(training_stages(heads))}
        if results:
            parts["results"] = results_table(results, options)
        elif _digest(tmp / WEIGHTS_FILE) != old_digest:
            parts["results"] = NOT_MEASURED
        (tmp / "README.md").write_text(fill_card(card, parts))
        (tmp / DRAFTER_OPTIONS_FILE).write_text(json.dumps(options) + "\n")

    return build_folder(out, fill)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("heads", type=Path, help="a heads folder of `specdraft train-heads --kind eagle3`")
    parser.add_argument("--results", type=Path, help="the output of benchmarks/eagle3_tau.py for these heads")
    parser.add_argument("--options", help="the drafter's default options, KEY=VALUE;KEY=VALUE (default: as shipped)")
    parser.add_argument("--out", type=Path, default=SHIPPED_HEADS[SMOLLM2_EAGLE3], help="the shipped folder")
    args = parser.parse_args(argv)
    from transformers import AutoConfig

    from specdraft.models.registry import resolve

    try:
        results = read_results(args.results) if args.results else None
        options = check_options(parse_options(args.options)) if args.options else None
        out = ship(args.heads, args.out, AutoConfig.from_pretrained(resolve(SMOLLM2)), results, options)
    except SpecdraftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"shipped {args.heads} as {out} ({(out / WEIGHTS_FILE).stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
