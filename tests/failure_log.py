"""pytest plugin (`-p tests.failure_log`): each failing test's report is appended, as the test
ends, to the file $PAGEWISE_FAILURE_LOG names. pytest prints tracebacks only in its final summary,
so a run killed at a time limit (gpu_check's test stage on a leased GPU) would otherwise say which
tests failed but not why. Under pytest-xdist the controller writes (workers forward their reports)."""

from __future__ import annotations

import os


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("PAGEWISE_FAILURE_LOG")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(path, "a") as f:
        f.write(f"\n----- {report.nodeid} ({report.when}) -----\n{report.longreprtext}\n")
