"""The benchmark suite's tables: a scenario's rows as Markdown, and BENCHMARKS.md rewritten between one
scenario's markers (`<!-- suite:NAME -->` ... `<!-- /suite:NAME -->`) with every other byte kept."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path

HEADER = ("| case | result | same-run ratio | machine | commit | date | command |\n"
          "|---|---|---:|---|---|---|---|")
# The ISA flags that decide which CPU kernels run (README: CPU kernels), in the order they matter.
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def markers(name: str) -> tuple[str, str]:
    return f"<!-- suite:{name} -->", f"<!-- /suite:{name} -->"


def machine() -> str:
    """The GPU where one is present, else the CPU model, its usable CPUs and ISA flags."""
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)} (1 GPU)"
    except Exception:  # a broken CUDA install still leaves the CPU to describe
        pass
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    isa = " ".join(f for f in ISA_FLAGS if f in flags) or "no AVX2"
    return f"{model}, {cpus} CPUs ({isa})"


def commit(root: Path) -> str:
    """The checkout's short commit; '+ local changes' where tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return f"`{head}`" + (" + local changes" if dirty else "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def row(case: str, result: str, ratio: str, machine_: str, commit_: str, date: str, command: str) -> str:
    cells = (case, result, ratio, machine_, commit_, date, f"`{command}`" if command else "")
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def block(scenario: dict, rows: list[str]) -> str:
    """The text between a scenario's markers: what it measures, its bar, the table."""
    start, end = markers(scenario["name"])
    lines = [start,
             f"*{scenario['measures']}.* Bar: {scenario['bar']}. Unit: {scenario['unit']}. "
             f"Run: `engine bench suite --only {scenario['name']}`.",
             "", HEADER, *rows, end]
    return "\n".join(lines)


def table_rows(text: str, name: str) -> list[str]:
    """The rows of a scenario's table as BENCHMARKS.md has them now."""
    inner = _span(text, name)[2]
    return [ln for ln in inner.splitlines() if ln.startswith("| ") and not ln.startswith(HEADER.splitlines()[0])]


def _span(text: str, name: str) -> tuple[int, int, str]:
    start, end = markers(name)
    if text.count(start) != 1 or text.count(end) != 1:
        raise ValueError(f"BENCHMARKS.md must hold {start} and {end} once each (found {text.count(start)} "
                         f"and {text.count(end)}); add them where the scenario's table goes")
    i, j = text.index(start), text.index(end) + len(end)
    if j < i:
        raise ValueError(f"{end} comes before {start} in BENCHMARKS.md")
    return i, j, text[i + len(start):j - len(end)]


def replace_block(text: str, scenario: dict, rows: list[str]) -> str:
    """`text` with one scenario's marked block rendered from `rows`; everything outside it unchanged."""
    i, j, _ = _span(text, scenario["name"])
    return text[:i] + block(scenario, rows) + text[j:]


def marked_names(text: str) -> list[str]:
    return re.findall(r"<!-- suite:([\w.-]+) -->", text)
