"""The README's two commands are what CI runs: the test command is .ci/run's, verbatim, and the
serve command installs the same way and runs `engine serve` with no flags (which
tests/server/test_server_default_model.py starts and asks for a capital)."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def _two_commands() -> tuple[str, str]:
    section = _read("README.md").split("## Two commands", 1)[1].split("\n## ", 1)[0]
    serve, test = re.findall(r"```bash\n(.+?)\n```", section, re.S)
    return serve.strip(), test.strip()


def test_ci_runs_the_readme_test_command_verbatim():
    _, test = _two_commands()
    ci_lines = [line.strip() for line in _read(".ci", "run").splitlines()]
    assert test in ci_lines, (test, ci_lines)


def test_the_serve_command_installs_like_ci_and_serves_with_no_flags():
    serve, test = _two_commands()
    install, _, run = serve.rpartition(" && ")
    assert run == "engine serve"
    assert install == test.rpartition(" && ")[0].replace('pip install -e ".[test]"', "pip install -e .")


def test_readme_points_at_nothing_outside_the_repository():
    text = _read("README.md")
    assert "../" not in text and "shared/" not in text
    for path in re.findall(r"`((?:engine|kernels|server|loadtest|tests)/[\w/.]+\.(?:py|cpp))`", text):
        assert os.path.exists(os.path.join(ROOT, path)), path
