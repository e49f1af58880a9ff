"""`engine plan serve --slo`: a plan that meets its targets, and a clear error when none can."""

import json
import subprocess
import sys

import pytest

SLO = ["serve", "--slo", "--model", "llama-3-70b", "--gpu", "h100-sxm", "--request-rate", "20", "--prompt-len",
       "512,1024,2048", "--output-len", "256"]


def plan(*argv):
    return subprocess.run([sys.executable, "-m", "engine.planning.cli", *argv], capture_output=True, text=True,
                          timeout=60)


def test_plan_meets_its_targets_and_prints_the_engine_serve_command():
    done = plan(*SLO, "--ttft-ms", "1000", "--tpot-ms", "40")
    assert done.returncode == 0, done.stderr
    assert "engine serve --model llama-3-70b" in done.stdout and "--max-num-seqs" in done.stdout
    out = json.loads(plan(*SLO, "--ttft-ms", "1000", "--tpot-ms", "40", "--json").stdout)
    p = out["prediction"]
    assert p["ttft"] <= 1.0 and p["tpot"] <= 0.040 and p["stable"]
    assert out["tp"] * out["replicas"] == out["gpus"] and out["gpus"] > 1  # 70B in bf16 needs more than one H100
    assert p["concurrency"] <= out["max_num_seqs"] <= out["kv_capacity_tokens"] // (2048 + 256)
    # a tighter TPOT target needs at least as many GPUs
    tight = json.loads(plan(*SLO, "--ttft-ms", "1000", "--tpot-ms", "20", "--json").stdout)
    assert tight["gpus"] >= out["gpus"] and tight["prediction"]["tpot"] <= 0.020


@pytest.mark.parametrize("argv, flag, says", [
    ([*SLO, "--ttft-ms", "1000", "--tpot-ms", "2", "--max-gpus", "16"], "--tpot-ms", "% over"),
    ([*SLO, "--ttft-ms", "1", "--tpot-ms", "100", "--max-gpus", "16"], "--ttft-ms", "% over"),
    ([*SLO, "--tpot-ms", "100"], "--slo", "--ttft-ms"),
    (["serve", "--slo", "--model", "llama-3-8b", "--request-rate", "1", "--ttft-ms", "1", "--tpot-ms", "1"], "--gpu",
     "h100-sxm"),
    (["serve", "--slo", "--model", "llama-3-8b", "--gpu", "h1000"], "--gpu", "mi300x"),
    (["serve", "--slo", "--model", "llama-3-8b", "--gpu", "h100-sxm", "--prompt-len", "0"], "--prompt-len", "positive"),
])
def test_slo_errors_name_the_constraint_and_by_how_much(argv, flag, says):
    done = plan(*argv)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    last = done.stderr.splitlines()[-1]
    assert flag in last and says in last, done.stderr
