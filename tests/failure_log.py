"""pytest plugin (`-p tests.failure_log --failure-log PATH`): each failing test's report is appended
to PATH as the test ends. pytest prints tracebacks only in its final summary, so a run killed at a
time limit (gpu_check's test stage under its time budget) would otherwise say which tests failed but not
why. Under pytest-xdist the controller writes (workers forward their reports to it)."""

from __future__ import annotations

_path: list[str] = []


def pytest_addoption(parser) -> None:
    parser.addoption("--failure-log", default=None, help="append each failing test's report to this file")


def pytest_configure(config) -> None:
    path = config.getoption("--failure-log")
    if path and not hasattr(config, "workerinput"):  # xdist workers forward, the controller writes
        _path.append(path)


def pytest_runtest_logreport(report) -> None:
    if not _path or not report.failed:
        return
    with open(_path[0], "a") as f:
        f.write(f"\n----- {report.nodeid} ({report.when}) -----\n{report.longreprtext}\n")
