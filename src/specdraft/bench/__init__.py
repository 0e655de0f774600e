"""``specdraft bench``: a Spec-Bench-style benchmark (Xia et al. 2024), records first.

The runner (:func:`run_bench`) answers Spec-Bench-format questions with every method, interleaved, and appends one
JSON record per answer to ``OUT/answers/<method>.jsonl`` (Spec-Bench's model_answer fields plus a per-turn timing
ledger and acceptance counts). The report (:func:`write_report`, :func:`summarize`) is a separate step over the
records: ``summary.json``, ``summary.md`` and PNG plots.

    from specdraft.bench import BenchConfig, run_bench
    summary = run_bench(BenchConfig(out="runs/b1", methods=("ar", "prompt-lookup"), per_category=2))
"""

from specdraft.bench.config import BenchConfig, parse_sweep
from specdraft.bench.methods import METHOD_KINDS, HFMethod, Method, SpecdraftMethod, TurnResult, parse_methods
from specdraft.bench.questions import CATEGORY_TO_SUBTASK, SUBTASKS, Question, load_questions, select_questions
from specdraft.bench.report import metrics, render_markdown, summarize, write_report
from specdraft.bench.runner import run_bench

__all__ = [
    "CATEGORY_TO_SUBTASK", "METHOD_KINDS", "SUBTASKS", "BenchConfig", "HFMethod", "Method", "Question",
    "SpecdraftMethod", "TurnResult", "load_questions", "metrics", "parse_methods", "parse_sweep", "render_markdown",
    "run_bench", "select_questions", "summarize", "write_report",
]
