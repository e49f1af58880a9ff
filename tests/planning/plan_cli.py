"""`engine plan` run as a user runs it: a real process, its exit code, stdout and stderr."""

from __future__ import annotations

import json
import subprocess
import sys


def plan(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.planning.cli", *argv], capture_output=True, text=True,
                          timeout=60)


def plan_json(*argv):
    done = plan(*argv, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
