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


def test_a_newcomer_finds_both_commands_on_the_first_screen():
    lines = _read("README.md").splitlines()
    serve, test = _two_commands()
    first_screen = "\n".join(lines[:40])
    assert serve in first_screen and test in first_screen
    assert len(lines) < 200, "the README is the first screen and the map; detail goes to docs/"


def test_every_page_the_readme_and_docs_link_exists():
    pages = ["README.md"] + [os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))]
    for page in pages:
        base = os.path.dirname(os.path.join(ROOT, page))
        for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[\w-]+)?\)", _read(page)):
            assert os.path.exists(os.path.join(base, target)), (page, target)
