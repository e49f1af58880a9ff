"""The `engine serve` command a serving plan prints runs as printed: pasted into a shell, it starts a
server that answers /health (for a preset, with $MODEL naming the weights' folder, as the plan's
comment line says)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import pytest

from tests.planning.plan_cli import plan
from tests.server.server_harness import clean_env

LOAD = ["--request-rate", "1", "--prompt-len", "64", "--output-len", "16", "--ttft-ms", "5000", "--tpot-ms", "1000"]
CPU = ["--gpu", "cpu", "--kv-cache-memory", "64MiB", *LOAD]  # this machine, measured first
GPU = ["--gpu", "h100-sxm", *LOAD]  # a preset of 8B on this CPU would take minutes to measure


def _printed_command(*argv: str) -> str:
    done = plan("serve", "--slo", *argv)
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("engine serve ")]
    return line


def _serves(line: str, tmp_path, env: dict) -> None:
    """Paste `line` into bash (on a port of the test's own) and wait for /health 200."""
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(["bash", "-c", f"exec {line} --port 0"], stdout=log, stderr=subprocess.STDOUT,
                            env={**clean_env(), **env})
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            text = (tmp_path / "serve.log").read_text()
            if "pagewise listening on " in text:
                url = text.split("pagewise listening on ", 1)[1].split()[0]
                assert httpx.get(url + "/health", timeout=10).status_code == 200
                return
            assert proc.poll() is None, f"the printed command failed:\n{line}\n{text[-3000:]}"
            time.sleep(0.2)
        raise TimeoutError(line)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        log.close()


@pytest.mark.slow
def test_the_command_for_a_model_folder_runs_as_printed(tiny_model_dir, tmp_path):
    line = _printed_command("--model", os.path.join(tiny_model_dir, "config.json"), *CPU)
    assert f"--model {tiny_model_dir} " in line  # the folder, which engine serve takes, not the config.json
    _serves(line, tmp_path, {})


@pytest.mark.slow
def test_the_command_for_a_preset_runs_as_printed_with_model_set(tiny_model_dir, tmp_path):
    done = plan("serve", "--slo", "--model", "llama-3-8b", *GPU)
    assert "# MODEL: the folder of llama-3-8b's config.json" in done.stdout
    # with speculation: the plan's --speculative-config JSON survives the paste
    line = _printed_command("--model", "llama-3-8b", *GPU, "--num-speculative-tokens", "3",
                            "--acceptance-rate", "0.6")
    assert '--model "$MODEL"' in line and """--speculative-config '{"method": "ngram", """ in line
    _serves(line, tmp_path, {"MODEL": tiny_model_dir})
