"""`--compare engine,vllm,hf`: each backend in its own process, one after the other.

The parent draws the requests once and writes them to a file; every child runs the same
CLI (`python -m engine.bench.cli MODE ... --backend X`) on that file with the same
settings and writes its result to a hidden JSON file. One process per backend keeps their
thread pools, allocators and compile caches apart, and lets vLLM run under its own
interpreter (`--vllm-python`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from engine.bench.backends.vllm import cpu_env
from engine.bench.common import peer_threads
from engine.bench.datasets import SampleRequest, save_requests
from engine.bench.launch import REPO_ROOT, python_path_env

# Options the parent consumes itself; children get everything else as given.
PARENT_ONLY = {"compare", "output_json", "plot", "backend", "requests_file", "result_json", "log_level"}


def child_argv(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Re-emit the options that differ from their defaults, so a child sees the same settings.

    One flag per setting (its first long spelling), whatever alias the user typed."""
    out: list[str] = []
    seen: set[str] = set()
    for action in parser._actions:
        if not action.option_strings or action.dest in PARENT_ONLY or action.dest in seen:
            continue
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        seen.add(action.dest)
        value, default = getattr(args, action.dest, action.default), action.default
        if isinstance(default, str) and callable(action.type):  # argparse converts string defaults
            default = action.type(default)
        if value == default or value is None:
            continue
        flag = next(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse.BooleanOptionalAction):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
            out.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for v in value:
                out += [flag, str(v)]
        else:
            out += [flag, str(value)]
    return out


def python_for(backend: str, args) -> str:
    if backend == "vllm" and getattr(args, "vllm_python", None):
        return args.vllm_python
    return sys.executable


def child_env(backend: str, args) -> dict[str, str]:
    extra = {"PYTHONUNBUFFERED": "1"}
    if backend == "vllm":
        try:
            import torch

            on_cuda = torch.cuda.is_available()
        except ImportError:
            on_cuda = False
        if not on_cuda:
            extra.update({k: os.environ.get(k, v) for k, v in cpu_env(peer_threads(args)).items()})
    return python_path_env(extra)


def run_children(mode: str, args, base_argv: list[str], requests: list[SampleRequest],
                 backends: list[str]) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as tmp:
        req_file = os.path.join(tmp, "requests.json")
        save_requests(requests, req_file)
        for b in backends:
            res_file = os.path.join(tmp, f"{b}.json")
            cmd = [python_for(b, args), "-m", "engine.bench.cli", mode, *base_argv, "--backend", b,
                   "--requests-file", req_file, "--result-json", res_file]
            print(f"\n=== {mode}: backend {b} ({cmd[0]}) ===", flush=True)
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=child_env(b, args))
            if os.path.exists(res_file):
                with open(res_file, encoding="utf-8") as f:
                    res = json.load(f)
            else:
                res = {"backend": b, "error": f"child exited with code {proc.returncode} and wrote no result"}
            if "error" in res:
                print(f"[{b}] failed:\n{res['error']}", file=sys.stderr)
            results.append(res)
    return results
