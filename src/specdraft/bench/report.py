"""The benchmark report: pure functions from answer records (and run.json) to summary.json's dict, then Markdown.

Metrics of a method over a set of answers (``M`` in summary.json), all sums over the answers' turns:

- ``block_efficiency`` τ = Σ new tokens / Σ decoding steps (target forward calls); null when not measured.
- ``acceptance_rate`` = Σ accepted / Σ proposed draft tokens (null when nothing was proposed);
  ``acceptance_rate_per_position[i]`` = Σ accepted at i / Σ drafts that reached position i.
- ``tokens_per_second`` = Σ new tokens / Σ wall time, taking for each question the median over repeats.
- ``speedup`` = tokens/s of the method ÷ tokens/s of ``ar``, both over the questions both answered. Wall time
  includes the prompt's prefill, as Spec-Bench's does.
- ``decode_speedup``: the same with each turn's prefill seconds taken out of its wall time, the speed-up of the
  decoding phase alone (the prefill is the same work for every method; with short answers to long prompts it is a
  large share of the wall time). Null when a method (or ``ar``) did not record its prefill (transformers' methods).
- ``mbsu`` (memory-bound speed-up) = τ / (γ·c + 1), with γ = num_draft_tokens and c the cost of one draft token
  relative to one target forward, *measured*: c = (Σ draft seconds / Σ proposed draft tokens) ÷ (Σ verify seconds
  / Σ decoding steps). Verify seconds are the target forward plus the accept/reject arithmetic. Null when c cannot
  be measured (no draft token proposed, or no timing ledger, as for transformers' methods).
- ``mbsu_param_ratio``: the same with c = draft parameters / target parameters (the memory-bound cost model of
  DistillSpec and Goel et al. 2024). A training-free drafter reads no weights: c = 0, so its value is τ.
  A method that drafts nothing (``ar``, ``hf``) has γ = 0 and mbsu = τ (= 1).
- ``greedy_equal``: under greedy decoding, whether every answer's token ids equal ``ar``'s for the same question;
  null under sampling, or when no answer could be compared. ``greedy_equal_answers`` = {"equal", "compared"};
  ``greedy_prefix_agreement`` = Σ tokens equal to ``ar``'s before each answer's first difference ÷ Σ ``ar``'s tokens
  (how far a lossy method, BiLD, follows plain decoding).
- ``num_draft_tokens`` (γ, null for methods that draft nothing) and ``n`` (questions answered).
- ``engine_counters``: another engine's own counters summed over the answers (vLLM's speculative-decoding
  metrics: ``drafts``, ``draft_tokens``, ``accepted_tokens``, ``accepted_tokens_per_pos``), with
  ``engine_acceptance_rate`` = accepted_tokens / draft_tokens from them; null for specdraft's own methods.

A method answered by another program (llama.cpp) also carries ``engine``, its build as its records give it
(:func:`specdraft.bench.llamacpp_build.build_summary`), beside ``overall`` and ``subtasks``.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from itertools import zip_longest
from pathlib import Path

from specdraft.bench.questions import SUBTASKS
from specdraft.bench.records import load_answers, read_run_info
from specdraft.errors import SpecdraftError
from specdraft.stats import add_counts, draft_lengths_line

BASELINE = "ar"


def _choice(record: dict) -> dict:
    return record["choices"][0]


def _sum_turns(records: Iterable[dict], key: str) -> float | None:
    """Σ of a per-turn field over records; None when any record lacks it."""
    total = 0
    for record in records:
        values = _choice(record).get(key)
        if values is None:
            return None
        total += sum(values)
    return total


def _sum_positions(records: Iterable[dict], key: str) -> list[int] | None:
    """Element-wise Σ of a per-turn list-of-counts field (accepted/reached per position)."""
    total: list[int] = []
    for record in records:
        per_turn = _choice(record).get(key)
        if per_turn is None:
            return None
        for counts in per_turn:
            add_counts(total, counts)
    return total


def engine_counters(records: Iterable[dict]) -> dict | None:
    """Σ over the answers' turns of an engine's own counters (numbers, and lists element-wise); None without any."""
    total: dict = {}
    for record in records:
        for counters in _choice(record).get("engine_counters") or []:
            for name, value in (counters or {}).items():
                if isinstance(value, list):
                    old = total.get(name, [])
                    total[name] = [a + b for a, b in zip_longest(old, value, fillvalue=0)]
                elif isinstance(value, (int, float)):
                    total[name] = total.get(name, 0) + value
    return total or None


def _by_question(records: Iterable[dict]) -> dict:
    groups: dict = defaultdict(list)
    for record in records:
        groups[record["question_id"]].append(record)
    return groups


def _seconds(record: dict, decode_only: bool) -> float | None:
    """The answer's wall time, less its prefill with ``decode_only`` (None when the prefill was not recorded)."""
    wall = sum(_choice(record)["wall_time"])
    if not decode_only:
        return wall
    prefill = _choice(record).get("prefill_seconds")
    return None if prefill is None else wall - sum(prefill)


def _speed(records: Sequence[dict], questions: set | None = None,
           decode_only: bool = False) -> tuple[float, float | None]:
    """(tokens, seconds) over ``questions`` (all when None): per question, the median over repeats; seconds is
    None when ``decode_only`` and some answer has no prefill time."""
    tokens, seconds = 0.0, 0.0
    for qid, group in _by_question(records).items():
        if questions is None or qid in questions:
            times = [_seconds(r, decode_only) for r in group]
            if any(t is None for t in times):
                return tokens, None
            tokens += statistics.median(sum(_choice(r)["new_tokens"]) for r in group)
            seconds += statistics.median(times)
    return tokens, seconds


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def speedup(records: Sequence[dict], baseline: Sequence[dict], decode_only: bool = False) -> float | None:
    """Method tokens/s ÷ baseline tokens/s over the questions both answered (with ``decode_only``, wall time less
    prefill); None without common questions or, decode-only, without prefill times."""
    common = {r["question_id"] for r in records} & {r["question_id"] for r in baseline}
    if not common:
        return None
    mine = _ratio(*_speed(records, common, decode_only))
    base = _ratio(*_speed(baseline, common, decode_only))
    return _ratio(mine, base)


def _compared(records: Sequence[dict], baseline: Sequence[dict], greedy: bool) -> list[tuple[list, list]] | None:
    """(token ids, the baseline's token ids for the same question (its first repeat)) per answer; None under
    sampling, or when nothing could be compared (no baseline answer, or a method without token ids)."""
    if not greedy:
        return None
    reference = {}
    for r in sorted(baseline, key=lambda r: r.get("repeat", 0)):
        reference.setdefault(r["question_id"], _choice(r).get("token_ids"))
    compared = [(_choice(r).get("token_ids"), reference.get(r["question_id"])) for r in records]
    compared = [(mine, theirs) for mine, theirs in compared if theirs is not None]
    if not compared or any(mine is None for mine, _ in compared):
        return None
    return compared


def greedy_comparison(records: Sequence[dict], baseline: Sequence[dict], greedy: bool) -> dict | None:
    """``{"equal": k, "compared": n}``: answers whose token ids equal the baseline's answer to the same question
    (its first repeat). None under sampling, or when nothing could be compared (no baseline answer, or a method
    without token ids)."""
    compared = _compared(records, baseline, greedy)
    if compared is None:
        return None
    return {"equal": sum(mine == theirs for mine, theirs in compared), "compared": len(compared)}


def greedy_prefix_agreement(records: Sequence[dict], baseline: Sequence[dict], greedy: bool) -> float | None:
    """Σ tokens equal to the baseline's before an answer's first difference ÷ Σ the baseline's tokens, over the
    answers :func:`greedy_comparison` compares (1.0 when every answer is equal); None when it compares none."""
    compared = _compared(records, baseline, greedy)
    if compared is None:
        return None
    agreed = reference = 0
    for mine, theirs in compared:  # per-turn lists of ids; a turn after a difference follows another context
        mine, theirs = [t for turn in mine for t in turn], [t for turn in theirs for t in turn]
        shared = min(len(mine), len(theirs))
        agreed += next((i for i in range(shared) if mine[i] != theirs[i]), shared)
        reference += len(theirs)
    return _ratio(agreed, reference)


def greedy_equal(records: Sequence[dict], baseline: Sequence[dict], greedy: bool) -> bool | None:
    """True if every answer's token ids equal the baseline's (see :func:`greedy_comparison`), None if unknown."""
    counts = greedy_comparison(records, baseline, greedy)
    return None if counts is None else counts["equal"] == counts["compared"]


def mbsu(tau: float | None, num_draft_tokens: int | None, c: float | None) -> float | None:
    """Memory-bound speed-up τ / (γ·c + 1); γ = 0 (no drafting) gives τ whatever c is."""
    if tau is None:
        return None
    if not num_draft_tokens:
        return tau
    return None if c is None else tau / (num_draft_tokens * c + 1)


def measured_cost_ratio(records: Sequence[dict]) -> float | None:
    """c = (Σ draft seconds / Σ proposed draft tokens) ÷ (Σ verify seconds / Σ decoding steps)."""
    per_draft_token = _ratio(_sum_turns(records, "draft_seconds"), _sum_turns(records, "draft_tokens_proposed"))
    per_forward = _ratio(_sum_turns(records, "verify_seconds"), _sum_turns(records, "decoding_steps"))
    return _ratio(per_draft_token, per_forward)


def accept_length_histogram(records: Iterable[dict]) -> list[int] | None:
    """counts[i] = decoding steps that committed i tokens (index 0 unused unless a step committed nothing)."""
    counts: list[int] = []
    for record in records:
        lengths = _choice(record).get("accept_lengths")
        if lengths is None:
            return None
        for n in lengths:
            counts += [0] * (n + 1 - len(counts))
            counts[n] += 1
    return counts


def _ledger(records: Sequence[dict]) -> dict:
    wall = _sum_turns(records, "wall_time")
    draft, verify = _sum_turns(records, "draft_seconds"), _sum_turns(records, "verify_seconds")
    prefill = _sum_turns(records, "prefill_seconds")
    overhead = None if draft is None or verify is None else max(0.0, wall - (prefill or 0.0) - draft - verify)
    return {"wall_seconds": wall, "prefill_seconds": prefill, "draft_seconds": draft, "verify_seconds": verify,
            "overhead_seconds": overhead}


def metrics(records: Sequence[dict], baseline: Sequence[dict], greedy: bool) -> dict:
    """M: the metrics of one method over ``records`` (one method's answers), against ``baseline`` (``ar``'s)."""
    tokens = _sum_turns(records, "new_tokens")
    tau = _ratio(tokens, _sum_turns(records, "decoding_steps"))
    accepted = _sum_positions(records, "accepted_per_position")
    reached = _sum_positions(records, "reached_per_position")
    gamma = records[0].get("num_draft_tokens") if records else None
    param_ratio = records[0].get("param_ratio") if records else None
    cost = measured_cost_ratio(records)
    counters = engine_counters(records)
    return {
        "block_efficiency": tau,
        "acceptance_rate": _ratio(_sum_turns(records, "draft_tokens_accepted"),
                                  _sum_turns(records, "draft_tokens_proposed")),
        "tokens_per_second": _ratio(*_speed(records)),
        "speedup": speedup(records, baseline),
        "decode_speedup": speedup(records, baseline, decode_only=True),
        "mbsu": mbsu(tau, gamma, cost),
        "greedy_equal": greedy_equal(records, baseline, greedy),
        "greedy_equal_answers": greedy_comparison(records, baseline, greedy),
        "greedy_prefix_agreement": greedy_prefix_agreement(records, baseline, greedy),
        "num_draft_tokens": gamma,
        "n": len(_by_question(records)),
        "mbsu_param_ratio": mbsu(tau, gamma, param_ratio),
        "draft_cost_ratio": cost,
        "param_ratio": param_ratio,
        "acceptance_rate_per_position": None if accepted is None or reached is None else
        [a / r for a, r in zip(accepted, reached, strict=True) if r],
        "accept_length_histogram": accept_length_histogram(records),
        "draft_length_counts": _sum_positions(records, "draft_length_counts"),
        "new_tokens": tokens,
        "n_records": len(records),
        "method": records[0].get("method") if records else None,
        "engine_counters": counters,
        "engine_acceptance_rate": _ratio(counters.get("accepted_tokens"), counters.get("draft_tokens"))
        if counters else None,
        **_ledger(records),
    }


def make_setup(run_info: dict) -> dict:
    """summary.json's ``setup``: the run's config, versions and hardware, from run.json."""
    config, env = run_info.get("config", {}), run_info.get("environment", {})
    temperature = config.get("temperature", 0.0)
    return {
        "target": config.get("target"),
        "dtype": run_info.get("precision") or config.get("dtype"),
        "sampling": {"greedy": temperature == 0.0, "temperature": temperature, "top_k": config.get("top_k"),
                     "top_p": config.get("top_p"), "seed": config.get("seed")},
        "max_new_tokens": config.get("max_new_tokens"),
        "num_draft_tokens": config.get("num_draft_tokens"),
        "sweep": {"num_draft_tokens": config["sweep"]} if config.get("sweep") else None,
        "repeats": config.get("repeats"),
        "methods": config.get("methods"),
        "questions": config.get("questions"),
        "questions_sha256": run_info.get("questions_sha256"),
        "categories": config.get("categories"),
        "per_category": config.get("per_category"),
        "speculation": config.get("speculation", ["fixed"]),
        "prefix_cache": config.get("prefix_cache", False),  # runs before it existed read every prompt whole
        "versions": env.get("versions"),
        "hardware": env.get("hardware"),
        "cost_curve": run_info.get("cost_curve"),  # the target's measured forward seconds (specdraft.costs)
        "command": run_info.get("command"),
        "started": run_info.get("started"),
    }


def _method_order(records: Sequence[dict], known: Sequence[str]) -> list[str]:
    names = dict.fromkeys([BASELINE, *known])
    names |= dict.fromkeys(r["model_id"] for r in records)
    present = {r["model_id"] for r in records}
    return [n for n in names if n in present]


def _best_num_draft_tokens(methods: dict) -> None:
    """For methods run at several γ (a sweep), mark every variant's overall M with the γ of the fastest one."""
    variants: dict = defaultdict(list)
    for m in methods.values():
        if m["overall"]["num_draft_tokens"] is not None and m["overall"]["tokens_per_second"] is not None:
            variants[m["overall"]["method"]].append(m["overall"])
    for group in variants.values():
        if len(group) > 1:
            best = max(group, key=lambda m: m["tokens_per_second"])
            for m in group:
                m["best_num_draft_tokens"] = best["num_draft_tokens"]


def summarize(records: Sequence[dict], run_info: dict) -> dict:
    """summary.json: ``{"setup": {...}, "methods": {NAME: {"overall": M, "subtasks": {SUBTASK: M}}}}`` (plus
    ``"engine"`` for a method another program answered)."""
    setup = make_setup(run_info)
    greedy = setup["sampling"]["greedy"]
    by_method: dict = defaultdict(list)
    for record in records:
        by_method[record["model_id"]].append(record)
    baseline = by_method.get(BASELINE, [])
    methods = {}
    for name in _method_order(records, run_info.get("method_names", ())):
        mine = by_method[name]
        subtasks = [s for s in SUBTASKS if any(r["subtask"] == s for r in mine)]
        methods[name] = {
            "overall": metrics(mine, baseline, greedy),
            "subtasks": {s: metrics([r for r in mine if r["subtask"] == s],
                                    [r for r in baseline if r["subtask"] == s], greedy) for s in subtasks},
        }
        if mine[-1].get("engine"):
            methods[name]["engine"] = mine[-1]["engine"]
    _best_num_draft_tokens(methods)
    return {"setup": setup, "methods": methods}


def _fmt(value, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}{suffix}"
    return str(value)


def _equal_count(counts: dict | None, prefix: float | None) -> str:
    """" (k/n)", with the prefix agreement when some answer differs: " (k/n; prefix 0.87)"."""
    if counts is None:
        return ""
    differ = prefix is not None and counts["equal"] < counts["compared"]
    return f" ({counts['equal']}/{counts['compared']}" + (f"; prefix {prefix:.2f})" if differ else ")")


def _overall_table(methods: dict) -> list[str]:
    rows = ["| method | γ | n | τ | acceptance | tokens/s | speed-up | decode-only speed-up | MBSU (c measured) "
            "| MBSU (c = params) | greedy equal |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in methods.items():
        o = m["overall"]
        equal = _equal_count(o["greedy_equal_answers"], o.get("greedy_prefix_agreement"))
        rows.append(f"| {name} | {_fmt(o['num_draft_tokens'])} | {o['n']} | {_fmt(o['block_efficiency'])} "
                    f"| {_fmt(o['acceptance_rate'])} | {_fmt(o['tokens_per_second'], 1)} "
                    f"| {_fmt(o['speedup'], 2, 'x')} | {_fmt(o.get('decode_speedup'), 2, 'x')} "
                    f"| {_fmt(o['mbsu'])} | {_fmt(o['mbsu_param_ratio'])} "
                    f"| {_fmt(o['greedy_equal'])}{equal} |")
    return rows


def _subtask_table(methods: dict, key: str, digits: int = 2, suffix: str = "") -> list[str]:
    subtasks = [s for s in SUBTASKS if any(s in m["subtasks"] for m in methods.values())]
    rows = [f"| method | {' | '.join(subtasks)} | overall |", "|---" * (len(subtasks) + 2) + "|"]
    for name, m in methods.items():
        cells = [_fmt(m["subtasks"][s][key] if s in m["subtasks"] else None, digits, suffix) for s in subtasks]
        rows.append(f"| {name} | {' | '.join(cells)} | {_fmt(m['overall'][key], digits, suffix)} |")
    return rows


def _speculation_lines(methods: dict) -> list[str]:
    """Per speculative method: acceptance per draft position and the draft lengths its steps verified."""
    lines = [f"- {name}: {line}" for name, m in methods.items() if m["overall"]["num_draft_tokens"]
             if (line := draft_lengths_line(m["overall"].get("acceptance_rate_per_position"),
                                            m["overall"].get("draft_length_counts")))]
    return ["## Acceptance per draft position and verified draft lengths", "", *lines, ""] if lines else []


def _engine_lines(methods: dict) -> list[str]:
    """One line per method another program answered: its build, as recorded."""
    lines = []
    for name, m in methods.items():
        e = m.get("engine")
        if not e:
            continue
        if not e.get("checked"):
            lines.append(f"`{name}`: {e.get('note', 'build unknown')}, weight repacking {_on(e.get('repack'))}.")
            continue
        flags = " ".join(e.get("c_flags") or []) or "none"
        lines.append(f"`{name}`: llama.cpp {e.get('commit')} (llama-cpp-python {e.get('llama_cpp_python')}), "
                     f"native flags, extra flags {flags}, AMX {_on(e.get('amx'))} ({e.get('amx_probe')}), "
                     f"weight repacking {_on(e.get('repack'))}, {e.get('threads', '?')} threads; built for "
                     f"{e.get('cpu')}.")
    return [*lines, ""] if lines else []


def _on(value) -> str:
    return "on" if value else "off"


def render_markdown(summary: dict) -> str:
    """summary.md: the setup in one line, the overall table, per-subtask tables of speed-up (wall and decode-only),
    τ and tokens/s."""
    s, methods = summary["setup"], summary["methods"]
    sampling = "greedy" if s["sampling"]["greedy"] else (
        f"temperature {s['sampling']['temperature']}, top-k {s['sampling']['top_k']}, top-p {s['sampling']['top_p']}")
    hardware = s.get("hardware") or {}
    gammas = ", ".join(map(str, s["sweep"]["num_draft_tokens"])) if s["sweep"] else s["num_draft_tokens"]
    lines = [
        "# specdraft bench", "",
        f"Target {s['target']}, {s['dtype']}, {sampling}, max_new_tokens {s['max_new_tokens']}, "
        f"num_draft_tokens (γ) {gammas}, repeats {s['repeats']}, prefix cache {_on(s.get('prefix_cache'))}; "
        f"{hardware.get('cpu', '?')}, {hardware.get('threads', '?')} threads.", "",
        *_engine_lines(methods),
        "## Overall", "", *_overall_table(methods), "",
        "## Speed-up over ar by subtask", "", *_subtask_table(methods, "speedup", 2, "x"), "",
        "## Decode-only speed-up over ar by subtask (prefill excluded)", "",
        *_subtask_table(methods, "decode_speedup", 2, "x"), "",
        "## Block efficiency τ by subtask", "", *_subtask_table(methods, "block_efficiency"), "",
        "## Tokens per second by subtask", "", *_subtask_table(methods, "tokens_per_second", 1), "",
        *_speculation_lines(methods),
    ]
    best = {m["overall"]["method"]: m["overall"]["best_num_draft_tokens"] for m in methods.values()
            if "best_num_draft_tokens" in m["overall"]}
    if best:
        lines += ["## Best num_draft_tokens (by tokens/s)", "", "| method | best γ |", "|---|---|"]
        lines += [f"| {name} | {k} |" for name, k in best.items()] + [""]
    return "\n".join(lines)


def write_report(out: str | Path, plots: bool = True) -> dict:
    """Read ``out``'s run.json and answers (without modifying them), write summary.json, summary.md and, with
    ``plots``, the PNG plots (skipped with a one-line warning when matplotlib is missing). Returns the summary."""
    from specdraft.bench.plots import PlotsUnavailable, write_plots

    out = Path(out)
    run_info = read_run_info(out)
    records = load_answers(out)
    if not records:
        raise SpecdraftError(f"no answers in {out / 'answers'} to report on")
    summary = summarize(records, run_info)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "summary.md").write_text(render_markdown(summary), encoding="utf-8")
    if plots:
        try:
            write_plots(summary, out)
        except PlotsUnavailable as exc:
            print(f"specdraft: warning: {exc}", file=sys.stderr)
    return summary
