"""The GPU recipe, time-boxed and resumable: the float32 check and the speed of distillation data, then prompts ->
exported drafters and EAGLE-3 heads for SmolLM2-135M-Instruct (``benchmarks/recipes/smollm2-gpu.toml`` through
``specdraft train-drafter``), then the exact greedy τ of the recipe's drafters and of the shipped one on the same
held-out answers. Everything it measures goes to ``--out``: ``summary.json`` (the numbers and the verdicts),
``logs/`` (one log per phase), ``runs/`` (each stage's train and eval logs, run.json and model card: the learning
curves), ``profile-*.txt`` (the data engine's top operators) and ``exports/`` (the best drafter and the heads).

Each phase runs in its own process under a time box (its share of ``--budget``, what earlier phases left unspent
carried forward); a phase that fails or runs out of time is recorded and the later ones still run on what exists
(a data stage stopped part-way leaves usable shards; a fine-tuning phase that did not finish leaves the previous
phase's export). The recipe's drafter phases come in lines, each its own phase here: ``drafter-shipped`` fine-tunes
the shipped drafter, ``drafter-copy`` the target's copied layers (a ``[[finetune]]`` phase that names its
``drafter`` starts a line); the drafter share is split between them in the ratio of their ``budget_s``.

Run again with the same ``--out`` and ``--work`` (after a call that was cut, say), it skips the phases that
finished and runs the others, whose stages continue from their checkpoints; ``--pack DIR`` writes the results
into DIR after every phase, within a device call's file limits (``gpu_device.py``). Needs torch, transformers,
safetensors and tokenizers (and ``gguf`` only to convert a .gguf target).

    python benchmarks/gpu_recipe.py --target TARGET --prompts prompts.jsonl.gz \
        --questions question.jsonl --out OUT [--budget 540] [--device auto] [--pack DIR]
    python benchmarks/gpu_recipe.py ... --tiny --device cpu --shipped DRAFTER   # the whole path at toy sizes
    python benchmarks/gpu_recipe.py ... --phases check,bench-native,profile     # the data engine alone
    python benchmarks/gpu_recipe.py ... --phases tests                          # tests/training, tests/heads
    python benchmarks/gpu_recipe.py --target TARGET --answers answers.jsonl.gz ...  # answers made elsewhere

``TARGET``: a transformers checkpoint folder of SmolLM2-135M-Instruct, or its GGUF file, converted once into
``--work``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib.util
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
# Each phase's share of the budget (about seconds at --budget 540); unspent time passes to the later phases. The
# drafter share is split between the recipe's lines. "tests" and "bench-hf" run only when named.
PLAN = {"tests": 100, "check": 25, "bench-native": 55, "profile": 20, "bench-hf": 30, "data": 100, "drafter": 250,
        "heads": 45, "tau": 35}
OPTIONAL = ("tests", "bench-hf")
TRAINED = 0.88  # of a training phase's box: its stages' budget_s (the rest: loading, copying layers, exporting)
TINY = {  # --tiny: the same path with a few prompts and steps and no stage budgets (a CPU test on a toy target)
    "heldout_data": {"limit": 6, "max_new_tokens": 12, "batch_size": 6, "shard_size": 6, "dtype": "float32"},
    "distill_data": {"limit": 24, "max_new_tokens": 12, "batch_size": 8, "shard_size": 8, "dtype": "float32"},
    "finetune": {"steps": 4, "batch_size": 4, "evals": 2, "heldout_every": 4, "bf16": False, "draft_vocab": 48,
                 "warmup_steps": 1, "max_seq_len": 128},
    "heads": {"steps": 4, "batch_size": 2, "evals": 2, "heldout_every": 4, "bf16": False, "warmup_steps": 1,
              "max_seq_len": 128, "options": "loss=fkl;ttt_steps=2;draft_vocab=48"},
}
PIDFILE = "phase.pid"  # in --work: the process group of the phase running now (ended by the next run if it outlived us)


# --- the plan -----------------------------------------------------------------------------------------------------


def load_recipe(path: str | Path) -> dict:
    import tomllib

    return tomllib.loads(Path(path).read_text())


def finetune_phases(spec: dict) -> list[dict]:
    return spec["finetune"] if isinstance(spec["finetune"], list) else [spec["finetune"]]


def drafter_lines(spec: dict) -> dict[str, list[dict]]:
    """The recipe's ``[[finetune]]`` phases by line, in order: a phase that names its ``drafter`` starts a line
    (``copy``: [init_drafter]'s output, ``shipped``: the shipped drafter, else that drafter's folder name); the
    others continue the line before (the first line starts from [init_drafter] unless it names another)."""
    lines: dict[str, list[dict]] = {}
    current: list[dict] | None = None
    copy = spec.get("init_drafter", {}).get("out")
    for phase in finetune_phases(spec):
        start = phase.get("drafter")
        if current is None or start is not None:
            name = "copy" if start in (None, copy) else "shipped" if start == SHIPPED else Path(start).name
            if name in lines:
                raise SystemExit(f"gpu_recipe: two drafter lines start from {start!r}")
            current = lines[name] = []
        current.append(phase)
    return lines


def plan(spec: dict) -> dict[str, float]:
    """Each phase's share, the drafter share split into one phase per line by the lines' ``budget_s``."""
    lines = drafter_lines(spec)
    weights = {name: sum(p.get("budget_s", 1.0) for p in phases) for name, phases in lines.items()}
    shares = {}
    for phase, share in PLAN.items():
        if phase == "drafter":
            shares |= {f"drafter-{n}": share * w / sum(weights.values()) for n, w in weights.items()}
        else:
            shares[phase] = share
    return shares


def choose_phases(text: str | None, shares: dict[str, float]) -> list[str]:
    """The phases named (``drafter``: every line; default: all but the optional ones), in plan order."""
    if not text:
        return [p for p in shares if p not in OPTIONAL]
    named = {p.strip() for p in text.split(",") if p.strip()}
    if "drafter" in named:
        named = (named - {"drafter"}) | {p for p in shares if p.startswith("drafter-")}
    unknown = sorted(named - set(shares))
    if unknown:
        raise SystemExit(f"gpu_recipe: --phases: unknown phase {unknown[0]!r}; the phases are "
                         f"{', '.join(shares)}, drafter")
    if not named:
        raise SystemExit("gpu_recipe: --phases: name at least one phase")
    return [p for p in shares if p in named]


class Clock:
    """The budget: each phase's time box is its share of what is left, over the phases still to run."""

    def __init__(self, budget: float, shares: dict[str, float], phases: list[str]) -> None:
        self.start, self.budget, self.shares, self.phases = time.monotonic(), budget, shares, phases

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start)

    def box(self, phase: str) -> float:
        later = self.phases[self.phases.index(phase):]
        return max(10.0, self.left() * self.shares[phase] / sum(self.shares[p] for p in later))


# --- running a phase ----------------------------------------------------------------------------------------------


class Phases:
    """Runs phases one at a time, each in its own process group, and records them in ``summary["phases"]``."""

    def __init__(self, out: Path, work: Path, env: dict, summary: dict, after) -> None:
        self.out, self.work, self.env, self.summary, self.after = out, work, env, summary, after
        self.process: subprocess.Popen | None = None
        self.current: str | None = None
        end_leftover(work / PIDFILE)
        signal.signal(signal.SIGTERM, self._stopped)

    def _stopped(self, signum, frame) -> None:  # the call's own time limit: end the phase, keep what is written
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.summary["phases"][self.current]["status"] = f"stopped (signal {signum})"
        raise SystemExit(128 + signum)

    def run(self, name: str, argv: list[str], seconds: float, env: dict | None = None) -> bool:
        """Run ``argv`` killed after ``seconds``; its output appended to ``out/logs/<name>.log``."""
        log, started = self.out / "logs" / f"{name}.log", time.monotonic()
        record = self.summary["phases"].setdefault(name, {})
        record |= {"status": "running", "time_box_s": round(seconds, 1), "call": self.summary["calls"]}
        with open(log, "a") as file:
            file.write(f"# call {self.summary['calls']}\n$ {' '.join(argv)}\n# time box {seconds:.0f} s\n")
            file.flush()
            self.process = subprocess.Popen(argv, stdout=file, stderr=subprocess.STDOUT, env=self.env | (env or {}),
                                            cwd=ROOT, process_group=0)
            (self.work / PIDFILE).write_text(str(self.process.pid))
            self.current = name
            try:
                code = self.process.wait(timeout=seconds)
                status = "ok" if code == 0 else f"failed (exit {code})"
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
                status = "timed out"
            finally:
                (self.work / PIDFILE).unlink(missing_ok=True)
                self.process = None
        record |= {"status": status, "seconds": round(time.monotonic() - started, 1)}
        print(f"[{name}] {status} in {record['seconds']} s (box {seconds:.0f} s)", flush=True)
        self.after()
        return status == "ok"


def end_leftover(pidfile: Path) -> None:
    """End the process group of a phase that an earlier run of this script left running (its run was killed)."""
    try:
        pid = int(pidfile.read_text())
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except (OSError, ValueError):
        pidfile.unlink(missing_ok=True)
        return
    if str(ROOT).encode() in command or b"specdraft" in command or b"benchmarks/" in command:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
            print(f"ended the phase left running by an earlier run (process group {pid})", flush=True)
    pidfile.unlink(missing_ok=True)


# --- the recipe and the target ------------------------------------------------------------------------------------


def prepare_target(target: str, work: Path) -> Path:
    """The cache folder the built-in name resolves to: a link to a checkpoint folder, or a GGUF converted there."""
    cache = work / "cache" / TARGET
    if (cache / "config.json").is_file():
        return cache
    cache.parent.mkdir(parents=True, exist_ok=True)
    source = Path(target)
    if (source / "config.json").is_file():
        if cache.is_symlink():
            cache.unlink()
        cache.symlink_to(source.resolve(), target_is_directory=True)
        return cache
    sys.path.insert(0, str(ROOT / "src"))
    from specdraft.models.registry import convert_gguf

    convert_gguf(source, cache, {"gguf": str(source)})
    return cache


def write_recipe(args, spec: dict, work: Path, box: float, line: str | None = None) -> Path:
    """The recipe as JSON: its paths under ``work``, the prompt files given, the --tiny settings and, for a drafter
    ``line``, that line's phases alone with their budgets from the phase's time box ``box``."""
    members = [] if line is None else drafter_lines(spec)[line]
    indices = [i for i, phase in enumerate(finetune_phases(spec)) if any(phase is m for m in members)]
    spec = json.loads(json.dumps(spec))
    spec["device"] = args.device
    if args.refill:
        spec["heldout_data"]["refill"] = spec["distill_data"]["refill"] = True
    spec["heldout_data"]["prompts"] = str(Path(args.questions).resolve())
    if args.answers:  # answers made elsewhere: read, not generated (distill-data --answers)
        for key in ("prompts", "engine", "refill"):
            spec["distill_data"].pop(key, None)
        spec["distill_data"]["answers"] = str(Path(args.answers).resolve())
    else:
        spec["distill_data"]["prompts"] = str(Path(args.prompts).resolve())
    copy = spec["init_drafter"]["out"]
    for section in [spec[s] for s in ("heldout_data", "distill_data", "init_drafter", "heads")] + finetune_phases(spec):
        section["out"] = str(work / section["out"])
    for phase in finetune_phases(spec):
        if phase.get("drafter") == copy:
            phase["drafter"] = str(work / copy)
        for key in ("drafter", "draft_vocab_from"):
            if phase.get(key) == SHIPPED:
                phase[key] = args.shipped
    if line is not None:
        chosen = [finetune_phases(spec)[i] for i in indices]
        total = sum(p.get("budget_s", 1.0) for p in chosen)
        for phase in chosen:
            phase["budget_s"] = round(box * TRAINED * phase.get("budget_s", 1.0) / total, 1)
        spec["finetune"] = chosen
    spec["heads"]["budget_s"] = round(box * TRAINED, 1)
    if args.tiny:
        for name, values in TINY.items():
            for section in finetune_phases(spec) if name == "finetune" else [spec[name]]:
                section.update(values)
                section.pop("budget_s", None)
                section.pop("draft_vocab_from", None)
    path = work / f"recipe-{line or 'all'}.json"
    path.write_text(json.dumps(spec, indent=1))
    return path


# --- the phases ---------------------------------------------------------------------------------------------------


def run_all(args, spec: dict, clock: Clock, todo: list[str], runner: Phases, work: Path, out: Path) -> None:
    python, tiny = sys.executable, args.tiny

    def phase(name: str, argv: list[str] | None = None, stages: str | None = None, line: str | None = None,
              clear: tuple[str, ...] = (), env: dict | None = None) -> None:
        if name not in todo:
            return
        box = clock.box(name)
        for file in clear:  # a phase run again starts its records afresh
            (out / file).unlink(missing_ok=True)
        if stages is not None:  # a recipe phase: its training budgets from this box
            argv = [python, "-m", "specdraft.cli", "train-drafter", "--config",
                    str(write_recipe(args, spec, work, box, line)), "--stages", stages]
        runner.run(name, argv, box, env)

    static = "static,static-refill" if tiny else "native,native-refill"  # --tiny: the CUDA path's batch, eager
    bench = [python, "benchmarks/bench_distill_data.py", "--target", TARGET, "--prompts", args.prompts,
             "--max-new-tokens", "8" if tiny else "256", "--device", args.device, "--ledger"]
    spread = ["-n", "8", "--dist", "loadfile"] if importlib.util.find_spec("xdist") and not tiny else []
    phase("tests", [python, "-m", "pytest", *args.tests.split(), "-v", "-rA", "--tb=short", "-p", "no:cacheprovider",
                    "-p", "pytest_report_now", f"--junitxml={out / 'tests-junit.xml'}", *spread],
          env={"PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), runner.env["PYTHONPATH"]])})
    phase("check", [python, "benchmarks/bench_distill_data.py", "--target", TARGET, "--prompts", args.prompts,
                    "--dtype", "float32", "--device", args.device, "--limit", "4" if tiny else "64", "--batch-sizes",
                    "2" if tiny else "32", "--max-new-tokens", "4" if tiny else "48", "--engines",
                    f"{static},hf", "--compare", "--json-out", str(out / "check.jsonl")],
          clear=("check.jsonl",))  # float32: the engines' answers must agree
    phase("bench-native", bench + ["--engines", static, "--batch-sizes", "4" if tiny else args.bench_batch,
                                   "--limit", "4" if tiny else str(args.bench_prompts),
                                   "--json-out", str(out / "bench-native.jsonl")], clear=("bench-native.jsonl",))
    phase("profile", bench + ["--engines", static.split(",")[0], "--batch-sizes", "4" if tiny else "1024",
                              "--limit", "4" if tiny else "1024", "--profile", str(out / "profile"),
                              "--json-out", str(out / "profile.jsonl")], clear=("profile.jsonl",))
    phase("bench-hf", bench + ["--engines", "hf", "--batch-sizes", "4" if tiny else str(args.hf_batch), "--limit",
                               "4" if tiny else str(args.hf_prompts), "--json-out", str(out / "bench-hf.jsonl")],
          clear=("bench-hf.jsonl",))
    phase("data", stages="heldout_data,distill_data")
    copy = spec["init_drafter"]["out"]
    for line, phases in drafter_lines(spec).items():
        first = phases[0].get("drafter", copy)
        phase(f"drafter-{line}", stages="init_drafter,finetune" if first == copy else "finetune", line=line)
    phase("heads", stages="heads")
    drafters = [args.shipped] + [str(p) for exports in line_exports(spec, work).values() for p in exports]
    phase("tau", [python, "benchmarks/heldout_tvd.py", "--target", TARGET, "--data",
                  str(work / spec["heldout_data"]["out"]), "--drafters", ",".join(drafters), "--num-draft-tokens",
                  "3,4,5", "--device", args.device, "--batch-size", "32", "--max-seq-len", "128" if tiny else "4096",
                  "--out", str(out / "tau.jsonl")], clear=("tau.jsonl",))


# --- results ------------------------------------------------------------------------------------------------------


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


def read_jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


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


def line_exports(spec: dict, work: Path) -> dict[str, list[Path]]:
    """Each drafter line's exported models so far, in phase order."""
    return {line: [work / p["out"] / "model" for p in phases if (work / p["out"] / "model" / "config.json").is_file()]
            for line, phases in drafter_lines(spec).items()}


def collect(spec: dict, work: Path, out: Path, summary: dict, keep_exports: bool) -> None:
    """Learning curves, data sizes, measured rows and exports into the summary and ``out``."""
    trained = [p["out"] for p in finetune_phases(spec)] + [spec["heads"]["out"]]
    for run in trained:
        folder, name = work / run, Path(run).name
        summary["curves"][name] = read_csv(folder / "eval_log.csv")
        if folder.is_dir():
            (out / "runs" / name).mkdir(parents=True, exist_ok=True)
            for file in ("train_log.csv", "eval_log.csv", "run.json", "model/README.md", "heads/README.md"):
                if (folder / file).is_file():
                    shutil.copy(folder / file, out / "runs" / name / file.replace("/", "-"))
    for name in ("heldout_data", "distill_data"):
        if (work / spec[name]["out"]).is_dir():
            summary["data"][name] = data_stats(work / spec[name]["out"])
    seconds = summary["phases"].get("data", {}).get("seconds")  # both sets, loading and records included
    if seconds and summary["data"]:
        tokens = sum(summary["data"][name]["answer_tokens"] for name in ("heldout_data", "distill_data")
                     if name in summary["data"])
        summary["data"]["answer_tokens_per_s_of_the_data_phase"] = round(tokens / seconds, 1)
    for name in ("check", "bench-native", "bench-hf", "profile", "tau"):
        summary[name] = read_jsonl(out / f"{name}.jsonl")
    exports = line_exports(spec, work)
    summary["lines"] = {line: {"runs": [Path(p["out"]).name for p in phases],
                               "final": str(exports[line][-1]) if exports[line] else None}
                        for line, phases in drafter_lines(spec).items()}
    summary["verdicts"] = verdicts(summary)
    best = summary["verdicts"]["best_line"] or next((n for n, v in reversed(summary["lines"].items()) if v["final"]),
                                                    None)
    if keep_exports:
        heads = work / spec["heads"]["out"] / "heads"
        for source, name in ((summary["lines"][best]["final"] if best else None, "drafter"), (heads, "eagle3-heads")):
            if source is not None and Path(source).is_dir():
                shutil.rmtree(out / "exports" / name, ignore_errors=True)
                shutil.copytree(source, out / "exports" / name)
        summary["exported_drafter"] = summary["lines"][best]["final"] if best else None


def verdicts(summary: dict) -> dict:
    """The figures the recipe is judged by, where they exist."""
    taus = {row["drafter"]: row for row in summary["tau"]}
    gammas = ("greedy_tau@3", "greedy_tau@4", "greedy_tau@5")
    shipped = {g: taus.get(summary["shipped"], {}).get(g) for g in gammas}
    lines = {name: {g: taus.get(line["final"], {}).get(g) for g in gammas} for name, line in summary["lines"].items()}
    scored = {name: tau["greedy_tau@4"] for name, tau in lines.items() if tau["greedy_tau@4"] is not None}
    best = max(scored, key=scored.get, default=None)
    recipe = [summary["phases"].get(p, {}) for p in ("data", *(f"drafter-{n}" for n in lines), "heads")]
    check = {r["engine"]: f"{r.get('same_answers_as_first_engine')}/{r['prompts']}" for r in summary["check"]}
    engines = [e for e in check if e.endswith("refill")]
    return {"distill_data_answer_tokens_per_s": max(
                (r["answer_tokens_per_s"] for r in summary["bench-native"]), default=None),
            "data_phase_answer_tokens_per_s": summary["data"].get("answer_tokens_per_s_of_the_data_phase"),
            "float32_answers_equal_to_transformers": check.get("hf"),
            "float32_refill_answers_equal": check[engines[0]] if engines else None,
            "recipe_seconds_prompts_to_exports": round(sum(r["seconds"] for r in recipe), 1)
            if all(r.get("status") == "ok" for r in recipe) else None,
            "greedy_tau_shipped": shipped, "greedy_tau_by_line": lines, "best_line": best,
            "greedy_tau@4_best": scored.get(best), "best_line_beats_shipped": None if best is None or
            shipped["greedy_tau@4"] is None else scored[best] > shipped["greedy_tau@4"],
            "greedy_tau@4_at_least_1.60": None if best is None else scored[best] >= 1.60}


def environment() -> dict:
    """Library versions and the hardware, read without importing torch (a second's worth of a short run)."""
    import importlib.metadata
    import platform

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    try:
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        gpus = []
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").is_file() else None
    return {"torch": version("torch"), "transformers": version("transformers"), "python": platform.python_version(),
            "gpus": gpus, "cpu": cpu, "cores": os.cpu_count()}


def finish(args, spec: dict, work: Path, out: Path, summary: dict) -> None:
    """Collect, write ``summary.json`` (beside, then renamed) and pack into ``--pack``."""
    collect(spec, work, out, summary, not args.no_exports)
    temporary = out / ".summary.json"
    temporary.write_text(json.dumps(summary, indent=1))
    os.replace(temporary, out / "summary.json")
    if args.pack:
        from gpu_device import pack_results

        pack_results(out, Path(args.pack))


# --- main ---------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="SmolLM2-135M-Instruct: a checkpoint folder or its GGUF")
    parser.add_argument("--prompts", help="training prompts (benchmarks/gpu_prompts.py); with --answers, their "
                                          "prompts by default")
    parser.add_argument("--answers", help="the target's answers made elsewhere (JSON Lines of prompt and answer_ids, "
                                          "distill-data --answers): the data phase reads them instead of generating")
    parser.add_argument("--questions", required=True, help="Spec-Bench's question.jsonl: the held-out questions")
    parser.add_argument("--out", required=True, help="where the logs, curves, summary and exports go")
    parser.add_argument("--work", default="/tmp/specdraft-gpu", help="where the runs are made")
    parser.add_argument("--budget", type=float, default=540, help="seconds for the phases this run does")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--recipe", default=str(ROOT / "benchmarks" / "recipes" / "smollm2-gpu.toml"))
    parser.add_argument("--shipped", default=SHIPPED, help="the drafter the shipped line starts from and τ compares "
                                                          "against (a name or a folder)")
    parser.add_argument("--bench-prompts", type=int, default=2048, help="prompts of the native engine's timing")
    parser.add_argument("--hf-prompts", type=int, default=1024, help="prompts of transformers' timing")
    parser.add_argument("--bench-batch", default="1024,2048", help="the native engine's batch sizes, comma-separated")
    parser.add_argument("--hf-batch", type=int, default=512, help="transformers' batch (left-padded to the longest)")
    parser.add_argument("--phases", help=f"the phases to run, comma-separated (default: all but {', '.join(OPTIONAL)}; "
                                         "'drafter' names every drafter line)")
    parser.add_argument("--tests", default="tests/training tests/heads", help="what the tests phase runs")
    parser.add_argument("--redo", action="store_true", help="run the phases that an earlier run finished too")
    parser.add_argument("--refill", action="store_true", help="the data stages with distill-data --refill")
    parser.add_argument("--tiny", action="store_true", help="a few prompts and steps (a CPU test)")
    parser.add_argument("--no-exports", action="store_true", help="do not copy the exports into --out")
    parser.add_argument("--pack", help="after every phase, the results packed into this folder (gpu_device.py)")
    args = parser.parse_args(argv)
    if args.prompts is None:
        if args.answers is None:
            parser.error("--prompts or --answers is required")
        args.prompts = args.answers  # each record holds its prompt
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    spec = load_recipe(args.recipe)
    shares = plan(spec)
    phases = choose_phases(args.phases, shares)
    out, work = Path(args.out), Path(args.work)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {"work": str(work), "calls": 0, "phases": {}, "data": {}, "curves": {}}
    summary |= {"calls": summary["calls"] + 1, "budget_s": args.budget, "shipped": args.shipped}
    done = [] if args.redo else [p for p in phases if summary["phases"].get(p, {}).get("status") == "ok"]
    todo = [p for p in phases if p not in done]
    print(f"phases to run: {', '.join(todo) or 'none'}" + (f" (finished earlier: {', '.join(done)})" if done else ""),
          flush=True)
    env = os.environ | {"SPECDRAFT_CACHE": str(work / "cache"), "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]), "SPECDRAFT_PREPACK": "0", "SPECDRAFT_ROWGEMM": "0",
        "PYTHONUNBUFFERED": "1"}
    runner = Phases(out, work, env, summary, lambda: finish(args, spec, work, out, summary))
    try:
        if set(todo) - {"tests"} and summary["phases"].get("target", {}).get("status") != "ok":
            started = time.monotonic()
            try:
                prepare_target(args.target, work)
                summary["phases"]["target"] = {"status": "ok", "seconds": round(time.monotonic() - started, 1)}
            except Exception as exc:  # reported; every later phase then fails on its own and says so
                summary["phases"]["target"] = {"status": f"failed: {exc}"}
        if "environment" not in summary:
            summary["environment"] = environment()
        run_all(args, spec, Clock(args.budget, shares, todo), todo, runner, work, out)
    finally:
        finish(args, spec, work, out, summary)
        print(json.dumps(summary["verdicts"]), flush=True)


if __name__ == "__main__":
    main()
