"""The GPU recipe, time-boxed: distillation-data speed, then prompts -> exported drafter and EAGLE-3 heads for
SmolLM2-135M-Instruct (``benchmarks/recipes/smollm2-gpu.toml`` through ``specdraft train-drafter``), then the exact
greedy τ of the recipe's drafters and of the shipped one on the same held-out answers. Everything it measures goes
to ``--out``: ``summary.json`` (the numbers), ``logs/`` (one log per phase), ``runs/`` (each stage's train and eval
logs, run.json and model card: the learning curves) and ``exports/`` (the drafter and heads).

Each phase runs in its own process under a time box (its share of ``--budget``, what earlier phases left unspent
carried forward); a phase that fails or runs out of time is recorded and the later ones still run on what exists
(a data stage stopped part-way leaves usable shards; a fine-tuning phase that did not finish leaves the previous
phase's export). Needs torch, transformers, safetensors and tokenizers (and ``gguf`` only to convert a .gguf target).

    python benchmarks/gpu_recipe.py --target TARGET --prompts prompts.jsonl.gz \
        --questions question.jsonl --out OUT [--budget 560] [--device auto]
    python benchmarks/gpu_recipe.py ... --tiny --device cpu      # the whole path in minutes on a CPU
    python benchmarks/gpu_recipe.py ... --phases check,bench-native  # the data engine's timing alone
    python benchmarks/gpu_recipe.py ... --phases data,drafter,heads,tau --budget 560   # the recipe alone

``TARGET``: a transformers checkpoint folder of SmolLM2-135M-Instruct, or its GGUF file (``A,B`` for the file in
parts, joined in order), converted once into ``--work``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = "smollm2-135m-instruct"  # the built-in name: its shipped drafter resolves against it
SHIPPED = "smollm2-135m-instruct-drafter"
# Each phase's share of the budget (about seconds at --budget 560); unspent time passes to the later phases.
PLAN = {"check": 30, "bench-native": 40, "bench-hf": 30, "data": 110, "drafter": 300, "heads": 80, "tau": 40}
TINY = {  # --tiny: the same path with a few prompts and steps, no budgets (a CPU test)
    "heldout_data": {"limit": 6, "max_new_tokens": 12, "batch_size": 6, "shard_size": 6, "dtype": "float32"},
    "distill_data": {"limit": 24, "max_new_tokens": 12, "batch_size": 8, "shard_size": 8, "dtype": "float32"},
    "finetune": {"steps": 4, "batch_size": 4, "evals": 2, "heldout_every": 4, "bf16": False, "draft_vocab": 4096},
    "heads": {"steps": 4, "batch_size": 2, "evals": 2, "heldout_every": 4, "bf16": False,
              "options": "loss=fkl;ttt_steps=2;draft_vocab=4096;aux_layers=2,15,27"},
}


class Clock:
    """The budget: each phase's time box is its share of what is left."""

    def __init__(self, budget: float, phases: list[str]) -> None:
        self.start, self.budget, self.phases = time.monotonic(), budget, phases

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start)

    def box(self, phase: str) -> float:
        later = self.phases[self.phases.index(phase):]
        return max(10.0, self.left() * PLAN[phase] / sum(PLAN[p] for p in later))


def run_phase(name: str, argv: list[str], seconds: float, out: Path, env: dict, summary: dict) -> bool:
    """Run ``argv`` in its own process group, killed after ``seconds``; its output in ``out/logs/<name>.log``."""
    log = out / "logs" / f"{name}.log"
    started = time.monotonic()
    with open(log, "w") as file:
        file.write(f"$ {' '.join(argv)}\n# time box {seconds:.0f} s\n")
        file.flush()
        process = subprocess.Popen(argv, stdout=file, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                   start_new_session=True)
        try:
            code = process.wait(timeout=seconds)
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            status = "timed out"
    summary["phases"][name] = {"status": status, "seconds": round(time.monotonic() - started, 1),
                               "time_box_s": round(seconds, 1)}
    print(f"[{name}] {status} in {summary['phases'][name]['seconds']} s (box {seconds:.0f} s)", flush=True)
    return status == "ok"


def prepare_target(target: str, work: Path) -> Path:
    """The cache folder the built-in name resolves to: a link to a checkpoint folder, or a GGUF converted there."""
    cache = work / "cache" / TARGET
    if (cache / "config.json").is_file():
        return cache
    cache.parent.mkdir(parents=True, exist_ok=True)
    parts = [Path(p) for p in target.split(",")]
    if len(parts) == 1 and (parts[0] / "config.json").is_file():
        cache.symlink_to(parts[0].resolve(), target_is_directory=True)
        return cache
    gguf = parts[0] if len(parts) == 1 else work / "target.gguf"
    if len(parts) > 1:
        with open(gguf, "wb") as joined:
            for part in parts:
                with open(part, "rb") as piece:
                    shutil.copyfileobj(piece, joined)
    sys.path.insert(0, str(ROOT / "src"))
    from specdraft.models.registry import convert_gguf

    convert_gguf(gguf, cache, {"gguf": str(gguf)})
    return cache


def write_recipe(args, work: Path, box: float) -> Path:
    """The recipe TOML as JSON, its paths under ``work``, the prompt files given, the training stages' budgets from
    the phase's time box ``box``, and the --tiny settings."""
    import tomllib

    spec = tomllib.loads(Path(args.recipe).read_text())
    spec["device"] = args.device
    if args.refill:
        spec["heldout_data"]["refill"] = spec["distill_data"]["refill"] = True
    spec["heldout_data"]["prompts"] = str(Path(args.questions).resolve())
    spec["distill_data"]["prompts"] = str(Path(args.prompts).resolve())
    for section in [spec[s] for s in ("heldout_data", "distill_data", "init_drafter", "heads")] + spec["finetune"]:
        section["out"] = str(work / section["out"])
    for index, phase in enumerate(spec["finetune"]):  # what is left of the box: copying the layers, loading
        phase["budget_s"] = round(box * (0.68 if index == 0 else 0.2), 1)
    spec["heads"]["budget_s"] = round(box * 0.8, 1)
    if args.tiny:
        for name, values in TINY.items():
            for section in spec[name] if isinstance(spec[name], list) else [spec[name]]:
                section.update(values)
                section.pop("budget_s", None)
    path = work / "recipe.json"
    path.write_text(json.dumps(spec, indent=1))
    return path


def read_csv(path: Path) -> list[dict]:
    try:
        with open(path, newline="") as file:
            return [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(file)]
    except OSError:
        return []


def _number(text: str):
    try:
        return float(text)
    except (TypeError, ValueError):
        return text


def data_stats(folder: Path) -> dict:
    """Records and answer tokens of a distill-data folder as it is (complete or not)."""
    records = tokens = 0
    for shard in sorted(folder.glob("shard-*.jsonl")):
        for line in shard.read_text().splitlines():
            records += 1
            tokens += len(json.loads(line)["response_token_ids"])
    manifest = folder / "manifest.json"
    complete = json.loads(manifest.read_text()).get("complete") if manifest.is_file() else False
    return {"records": records, "answer_tokens": tokens, "complete": complete}


def collect(work: Path, out: Path, summary: dict, keep_exports: bool) -> None:
    """Learning curves, data sizes and exports into the summary and ``out``."""
    runs = work / "runs"
    for name in ("fkl", "tvdpp", "eagle3"):
        folder = runs / name
        summary["curves"][name] = read_csv(folder / "eval_log.csv")
        if folder.is_dir():
            (out / "runs" / name).mkdir(parents=True, exist_ok=True)
            for file in ("train_log.csv", "eval_log.csv", "run.json", "model/README.md", "heads/README.md"):
                if (folder / file).is_file():
                    shutil.copy(folder / file, out / "runs" / name / file.replace("/", "-"))
    for name in ("heldout", "data"):
        if (runs / name).is_dir():
            summary["data"][name] = data_stats(runs / name)
    seconds = summary["phases"].get("data", {}).get("seconds")  # both sets, loading and records included
    if seconds and "data" in summary["data"]:
        tokens = sum(summary["data"][name]["answer_tokens"] for name in summary["data"])
        summary["data"]["answer_tokens_per_s_of_the_data_phase"] = round(tokens / seconds, 1)
    if keep_exports:
        drafter = final_drafter(work)
        for source, name in ((drafter, "drafter"), (runs / "eagle3" / "heads", "eagle3-heads")):
            if source is not None and source.is_dir():
                shutil.copytree(source, out / "exports" / name, dirs_exist_ok=True)


def final_drafter(work: Path) -> Path | None:
    """The recipe's drafter: the last fine-tuning phase that exported (TVD++, else forward KL)."""
    for name in ("tvdpp", "fkl"):
        if (work / "runs" / name / "model" / "config.json").is_file():
            return work / "runs" / name / "model"
    return None


def verdicts(summary: dict) -> dict:
    """The figures the recipe is judged by, where they exist."""
    native = [r for r in summary["bench"] if r["engine"] != "hf"]
    taus = {row["drafter"]: row.get("greedy_tau@4") for row in summary["tau"]}
    drafter = final_drafter(Path(summary["work"]))
    shipped, final = taus.get(SHIPPED), taus.get(str(drafter)) if drafter else None
    recipe = [summary["phases"][p].get("seconds", 0) for p in ("data", "drafter", "heads") if p in summary["phases"]]
    check = {r["engine"]: r.get("same_answers_as_first_engine") for r in summary.get("check", [])}
    return {"distill_data_answer_tokens_per_s": max((r["answer_tokens_per_s"] for r in native), default=None),
            "float32_answers_equal_to_transformers": check.get("hf"),
            "float32_refill_answers_equal": check.get("native-refill", check.get("static-refill")),
            "recipe_seconds_prompts_to_exports": round(sum(recipe), 1) if len(recipe) == 3 else None,
            "recipe_drafter": str(drafter) if drafter else None, "greedy_tau@4_recipe": final,
            "greedy_tau@4_shipped": shipped,
            "recipe_tau_at_least_shipped": None if final is None or shipped is None else final >= shipped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="SmolLM2-135M-Instruct: a checkpoint folder or its GGUF")
    parser.add_argument("--prompts", required=True, help="training prompts (benchmarks/gpu_prompts.py)")
    parser.add_argument("--questions", required=True, help="Spec-Bench's question.jsonl: the held-out questions")
    parser.add_argument("--out", required=True, help="where the logs, curves, summary and exports go")
    parser.add_argument("--work", default="/tmp/specdraft-gpu", help="where the runs are made")
    parser.add_argument("--budget", type=float, default=560, help="seconds for everything")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--recipe", default=str(ROOT / "benchmarks" / "recipes" / "smollm2-gpu.toml"))
    parser.add_argument("--bench-prompts", type=int, default=4096, help="prompts of the native engine's timing")
    parser.add_argument("--hf-prompts", type=int, default=1024, help="prompts of transformers' timing")
    parser.add_argument("--bench-batch", default="1024,2048", help="the native engine's batch sizes, comma-separated")
    parser.add_argument("--hf-batch", type=int, default=512, help="transformers' batch (left-padded to the longest)")
    parser.add_argument("--phases", default=",".join(PLAN), help="the phases to run (in the order above; a later "
                                                                  "one uses what earlier runs left in --work)")
    parser.add_argument("--refill", action="store_true", help="the data stages with distill-data --refill")
    parser.add_argument("--tiny", action="store_true", help="a few prompts and steps (a CPU test)")
    parser.add_argument("--no-exports", action="store_true", help="do not copy the exports into --out")
    args = parser.parse_args()
    chosen = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = sorted(set(chosen) - set(PLAN))
    if unknown or not chosen:
        parser.error(f"--phases: unknown phase {unknown[0]!r}; the phases are {', '.join(PLAN)}" if unknown
                     else "--phases: name at least one phase")
    args.phases = [p for p in PLAN if p in chosen]
    clock, out, work = Clock(args.budget, args.phases), Path(args.out), Path(args.work)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    summary = {"work": str(work), "budget_s": args.budget, "phases": {}, "bench": [], "data": {}, "curves": {},
               "tau": []}
    env = os.environ | {"SPECDRAFT_CACHE": str(work / "cache"), "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]), "SPECDRAFT_PREPACK": "0", "SPECDRAFT_ROWGEMM": "0",
        "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    try:
        prepare_target(args.target, work)
        summary["phases"]["target"] = {"status": "ok", "seconds": round(time.monotonic() - started, 1)}
    except Exception as exc:  # reported; every later phase then fails on its own and says so
        summary["phases"]["target"] = {"status": f"failed: {exc}"}
    try:
        run_all(args, clock, out, work, env, summary)
    finally:
        summary["environment"] = environment()
        collect(work, out, summary, not args.no_exports)
        summary["verdicts"] = verdicts(summary)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary["verdicts"]), flush=True)


def run_all(args, clock: Clock, out: Path, work: Path, env: dict, summary: dict) -> None:
    python, tiny = sys.executable, args.tiny
    bench = [python, "benchmarks/bench_distill_data.py", "--target", TARGET, "--prompts", args.prompts,
             "--max-new-tokens", "8" if tiny else "256", "--device", args.device,
             "--json-out", str(out / "bench.jsonl")]
    batch = "4" if tiny else args.bench_batch  # --tiny: the static batch of the CUDA path, eager on the CPU
    few = "2" if tiny else "32"
    check = [python, "benchmarks/bench_distill_data.py", "--target", TARGET, "--prompts", args.prompts, "--dtype",
             "float32", "--device", args.device, "--limit", "4" if tiny else "64", "--batch-sizes", few,
             "--max-new-tokens", "4" if tiny else "48", "--engines",
             "static,static-refill,hf" if tiny else "native,native-refill,hf", "--compare",
             "--json-out", str(out / "check.jsonl")]
    def phase(name: str, argv: list[str] | None = None, sections: str | None = None) -> None:
        if name not in args.phases:
            return
        box = clock.box(name)
        if sections is not None:  # a recipe phase: its training budgets from this box
            argv = [python, "-m", "specdraft.cli", "train-drafter", "--config", str(write_recipe(args, work, box)),
                    "--stages", sections]
        run_phase(name, argv, box, out, env, summary)

    phase("check", check)  # float32: the engines' answers must agree
    phase("bench-native", bench + ["--engines", "static,static-refill" if tiny else "native,native-refill",
                                   "--batch-sizes", batch, "--limit",
                                   "4" if tiny else str(args.bench_prompts)])
    phase("bench-hf", bench + ["--engines", "hf", "--batch-sizes", "4" if tiny else str(args.hf_batch), "--limit",
                               "4" if tiny else str(args.hf_prompts)])
    for name in ("bench", "check"):
        path = out / f"{name}.jsonl"
        summary[name] = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    phase("data", sections="heldout_data,distill_data")
    phase("drafter", sections="init_drafter,finetune")
    phase("heads", sections="heads")
    drafters = [SHIPPED] + [str(work / "runs" / n / "model") for n in ("tvdpp", "fkl")
                            if (work / "runs" / n / "model" / "config.json").is_file()]
    phase("tau", [python, "benchmarks/heldout_tvd.py", "--target", TARGET, "--data", str(work / "runs" / "heldout"),
                  "--drafters", ",".join(drafters), "--num-draft-tokens", "3,4,5", "--device", args.device,
                  "--batch-size", "32", "--max-seq-len", "4096", "--out", str(out / "tau.jsonl")])
    if (out / "tau.jsonl").is_file():
        summary["tau"] = [json.loads(line) for line in (out / "tau.jsonl").read_text().splitlines()]


def environment() -> dict:
    import platform

    import torch
    import transformers

    sys.path.insert(0, str(ROOT / "src"))
    from specdraft.hardware import cpu_model

    cuda = torch.cuda.is_available()
    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name(0) if cuda else None, "cpu": cpu_model(), "cores": os.cpu_count()}


if __name__ == "__main__":
    main()
