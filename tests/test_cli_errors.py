"""A CLI error is one line that names the flag or value and says what to do: a pasted vLLM flag
gets what to use here instead, an unknown flag where the flags are listed, a bad setting no
traceback (each command run as a user runs it: a real process, its exit code and stderr)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv, says", [
    (["serve", "--trust-remote-code"], "engine serve: error: --trust-remote-code is a vLLM flag with no counterpart "
                                       "here: not needed"),
    (["serve", "--generation-config", "auto"], "--generation-config is a vLLM flag"),
    (["serve", "--swap-space=4"], "--swap-space is a vLLM flag with no counterpart here: preempted requests are "
                                  "recomputed"),
    (["generate", "hi", "--disable-log-requests"], "engine generate: error: --disable-log-requests is a vLLM flag"),
    (["serve", "--no-such-flag"], "engine serve: error: unrecognized arguments: --no-such-flag (`engine serve --help` "
                                  "lists the flags)"),
    (["bench", "serve", "--no-such-flag", "1"], "engine bench serve: error: unrecognized arguments: --no-such-flag 1"),
    (["serve", "--port", "abc"], "engine serve: error: argument --port: invalid int value: 'abc'"),
])
def test_a_refused_flag_is_one_line_saying_what_to_do(argv, says):
    done = run("-m", "engine", *argv)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [done.stderr.strip()] and says in done.stderr, done.stderr
    assert done.stderr.startswith("engine "), done.stderr


def test_the_bubble_tool_says_a_bad_model_in_one_line():
    done = run("-m", "engine.bench.bubble", "--model", os.path.join(ROOT, "no-such-model"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"python -m engine.bench.bubble: error: model path {os.path.join(ROOT, 'no-such-model')!r} does not exist: "
        "pass a folder with config.json and *.safetensors, a .gguf file, or no model for the embedded default"]
