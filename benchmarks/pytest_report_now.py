"""A pytest plugin that prints each failure's traceback as soon as the test fails (``-p pytest_report_now``, this
folder on ``PYTHONPATH``), so that a run stopped by its time box still names and explains what failed so far; the
``-rA`` summary comes only at the end."""

from __future__ import annotations


def pytest_runtest_logreport(report) -> None:
    if report.failed:
        print(f"\n==== FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n==== end of {report.nodeid}",
              flush=True)
