"""PNG plots of a benchmark summary (matplotlib, Agg backend, imported only here and only when plotting).

- ``speedup_by_subtask.png``: speed-up over ``ar`` per subtask and overall, grouped bars per method.
- ``accept_lengths.png``: per speculative method, the share of decoding steps that committed 1, 2, ... tokens.
- ``block_efficiency_vs_num_draft_tokens.png``: τ and speed-up against γ, when some method ran at several γ.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from specdraft.bench.questions import SUBTASKS
from specdraft.errors import SpecdraftError


class PlotsUnavailable(SpecdraftError):
    """matplotlib is not installed."""


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotsUnavailable("plots need matplotlib (pip install 'matplotlib>=3.7'); "
                               "summary.json and summary.md were written") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _speedup_by_subtask(plt, methods: dict, path: Path) -> None:
    shown = {n: m for n, m in methods.items() if n != "ar"}
    groups = [s for s in SUBTASKS if any(s in m["subtasks"] for m in shown.values())] + ["overall"]
    width = 0.8 / max(len(shown), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) + 0.4 * len(shown)), 4))
    for i, (name, m) in enumerate(shown.items()):
        values = [(m["overall"] if g == "overall" else m["subtasks"].get(g, {})).get("speedup") for g in groups]
        xs = [j + (i - (len(shown) - 1) / 2) * width for j in range(len(groups))]
        ax.bar(xs, [v if v is not None else 0.0 for v in values], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), groups, rotation=20)
    ax.set_ylabel("speed-up over ar (tokens/s ratio)")
    ax.set_title("Speed-up by subtask")
    if shown:  # below the axes: inside, it covered the tallest bars
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.25), ncols=min(len(shown), 3))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _accept_lengths(plt, methods: dict, path: Path) -> None:
    shown = {n: (m["overall"]["num_draft_tokens"], m["overall"]["accept_length_histogram"]) for n, m in methods.items()
             if m["overall"]["num_draft_tokens"] and m["overall"]["accept_length_histogram"]}
    cols = max(1, min(3, len(shown)))
    rows = max(1, -(-len(shown) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, (name, (gamma, counts)) in zip(axes.flat, shown.items(), strict=False):
        total = sum(counts) or 1
        lengths = range(1, max(len(counts), gamma + 2))  # 1 (nothing accepted) .. γ + 1 (all accepted + bonus)
        ax.bar(lengths, [(counts[n] if n < len(counts) else 0) / total for n in lengths])
        ax.set_xticks(list(lengths))
        ax.set_title(name, fontsize="small")
        ax.set_xlabel("tokens committed per step")
        ax.set_ylabel("share of steps")
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    if not shown:
        axes.flat[0].text(0.5, 0.5, "no speculative method with a per-step record", ha="center", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _sweep_series(methods: dict) -> dict:
    series: dict = defaultdict(list)
    for m in methods.values():
        o = m["overall"]
        if o["num_draft_tokens"] is not None:
            series[o["method"]].append((o["num_draft_tokens"], o["block_efficiency"], o["speedup"]))
    return {name: sorted(points) for name, points in series.items() if len(points) > 1}


def _sweep(plt, series: dict, path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    nan = float("nan")
    for name, points in series.items():
        points = [tuple(nan if v is None else v for v in p) for p in points]
        gammas = [p[0] for p in points]
        left.plot(gammas, [p[1] for p in points], marker="o", label=name)
        right.plot(gammas, [p[2] for p in points], marker="o", label=name)
    for ax in (left, right):
        ax.set_xticks(sorted({p[0] for points in series.values() for p in points}))
    left.set(xlabel="num_draft_tokens γ", ylabel="block efficiency τ", title="τ vs γ")
    right.set(xlabel="num_draft_tokens γ", ylabel="speed-up over ar", title="speed-up vs γ")
    right.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    left.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_plots(summary: dict, out: str | Path) -> list[Path]:
    """Write the plots of ``summary`` into ``out``; return their paths. PlotsUnavailable without matplotlib."""
    plt = _pyplot()
    out, methods = Path(out), summary["methods"]
    paths = [out / "speedup_by_subtask.png", out / "accept_lengths.png"]
    _speedup_by_subtask(plt, methods, paths[0])
    _accept_lengths(plt, methods, paths[1])
    series = _sweep_series(methods)
    if series:
        paths.append(out / "block_efficiency_vs_num_draft_tokens.png")
        _sweep(plt, series, paths[-1])
    return paths
