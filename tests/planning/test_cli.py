"""`engine plan` as a user runs it: `python -m engine.planning.cli` in a subprocess."""

import subprocess
import sys

import pytest

from engine.planning import ModelSpec, kv_bytes_per_token, kv_capacity_tokens
from engine.planning.units import GiB
from tests.planning.plan_cli import plan, plan_json

TRAIN_KEYS = {"params", "global_batch", "steps", "flops", "time_s", "memory_per_gpu", "activations_per_layer",
              "cpu_memory", "fits"}
MEMORY_KEYS = {"weights", "gradients", "optimizer", "activations", "total"}
SERVE_KEYS = {"params", "weights_per_gpu", "kv_bytes_per_token", "kv_capacity_tokens", "max_seqs_at_max_len"}
TRAIN = ["train", "--model", "llama-2-7b", "--seq-len", "4096", "--tokens", "1e9"]


def test_train_json_keys_and_plain_numbers():
    out = plan_json(*TRAIN, "--nodes", "2", "--gpus-per-node", "8", "--zero", "3", "--offload", "optimizer+params",
                    "--gpu-memory-gib", "80", "--peak-tflops", "989", "--time-per-step", "2.5")
    assert TRAIN_KEYS <= out.keys() and MEMORY_KEYS <= out["memory_per_gpu"].keys()
    assert out["memory_per_gpu"]["weights"] == 0 and out["cpu_memory"] > 0  # offloaded, reported as CPU memory
    assert out["time_s"] == out["steps"] * 2.5 and 0 < out["mfu"] < 1
    assert isinstance(out["flops"], float) and isinstance(out["memory_per_gpu"]["total"], int)


def test_serve_json_keys_and_fixed_kv_budget_matches_the_engine_rule():
    out = plan_json("serve", "--model", "qwen2.5-0.5b", "--dtype", "float32", "--kv-cache-memory", "1.5GiB",
                    "--max-model-len", "2048")
    assert SERVE_KEYS <= out.keys()
    spec = ModelSpec.from_preset("qwen2.5-0.5b")
    expected = kv_capacity_tokens(int(1.5 * GiB), kv_bytes_per_token(spec, 4), 16)  # what the engine computes on CPU
    assert out["kv_capacity_tokens"] == expected
    assert out["max_seqs_at_max_len"] == expected // 2048


def test_search_json_lists_fitting_plans_best_first():
    out = plan_json("search", "--model", "llama-2-7b", "--gpus-per-node", "8", "--gpu-memory-gib", "80",
                    "--seq-len", "4096", "--global-batch", "64", "--tokens", "1e10", "--achieved-tflops", "400",
                    "--top", "3")
    assert len(out["plans"]) == 3 and out["fitting"] >= 3
    times = [p["time_s"] for p in out["plans"]]
    assert times == sorted(times)
    for p in out["plans"]:
        assert TRAIN_KEYS <= p.keys() and p["fits"] and p["memory_per_gpu"]["total"] <= 80 * GiB


def test_engine_serve_spellings_mean_the_same_here():
    """Flags copied from `engine serve` (or vLLM) give the plan the old spellings gave."""
    base = ["serve", "--model", "llama-3-8b", "--gpu-memory-gib", "80", "--max-model-len", "4096"]
    old = plan_json(*base, "--tp", "2", "--dtype", "bfloat16", "--kv-dtype", "float16", "--kv-cache-memory-gib", "1.5")
    for new in (["--tensor-parallel-size", "2", "--dtype", "bf16", "--kv-cache-dtype", "half",
                 "--kv-cache-memory", "1.5GiB"],
                ["-tp", "2", "--dtype", "auto", "--kv-cache-dtype", "fp16", "--kv-cache-memory", "1536MiB"]):
        assert plan_json(*base, *new) == old
    train = plan_json(*TRAIN, "--dtype", "bf16", "-tp", "2", "-pp", "2", "--gpus-per-node", "4")
    assert train == plan_json(*TRAIN, "--dtype", "bfloat16", "--tp", "2", "--pp", "2", "--gpus-per-node", "4")


def test_old_kv_flag_warns_and_abbreviations_are_refused():
    done = plan("serve", "--model", "llama-3-8b", "--kv-cache-memory-gib", "1.5", "--log-level", "debug")
    assert done.returncode == 0 and "--kv-cache-memory-gib is deprecated: use --kv-cache-memory 1.5GiB" in done.stderr
    done = plan("serve", "--model", "llama-3-8b", "--kv-cache-mem", "2GiB")
    assert done.returncode == 2 and "unrecognized arguments: --kv-cache-mem" in done.stderr


@pytest.mark.parametrize("command", [
    [*TRAIN, "--gpu-memory-gib", "80"],
    ["serve", "--model", "llama-3-8b", "--gpu-memory-gib", "80"],
    ["search", "--model", "gpt2", "--gpu-memory-gib", "24", "--seq-len", "1024", "--global-batch", "8",
     "--tokens", "1e8"],
])
def test_tables_by_default(command):
    done = plan(*command)
    assert done.returncode == 0, done.stderr
    assert "GiB" in done.stdout and not done.stdout.lstrip().startswith("{")


@pytest.mark.parametrize("argv, flag", [
    ([*TRAIN, "--gpus-per-node", "0"], "--gpus-per-node"),
    ([*TRAIN, "--tp", "3", "--gpus-per-node", "3"], "--tp"),
    ([*TRAIN, "--tp", "2"], "--tensor-parallel-size/-tp/--tp"),  # 2-way TP on one GPU
    (["serve", "--model", "llama-2-7b", "--kv-cache-memory", "0GiB"], "--kv-cache-memory"),
    (["serve", "--model", "llama-2-7b", "--gpu-memory-gib", "80", "-pp", "33"], "--pipeline-parallel-size"),
    (["train", "--layers", "2", "--hidden", "-64", "--heads", "4", "--vocab", "100", "--seq-len", "8",
      "--tokens", "8"], "--hidden"),
    (["train", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "3", "--vocab", "100",
      "--seq-len", "8", "--tokens", "8"], "--kv-heads"),
    ([*TRAIN, "--zero", "1", "--offload", "optimizer"], "--offload"),
    ([*TRAIN, "--mfu", "0.5"], "--mfu"),
    (["train", "--model", "llama-2-7b", "--seq-len", "4096"], "--tokens"),
    (["train", "--model", "no-such-model", "--seq-len", "8", "--tokens", "8"], "--model"),
    (["serve", "--model", "llama-2-7b"], "--gpu-memory-gib"),
    (["serve", "--model", "llama-2-7b", "--gpu-memory-gib", "80", "--gpu-memory-utilization", "1.5"],
     "--gpu-memory-utilization"),
    # Each must name its flag, because inf can overflow into a traceback or plan nonsense (a 0 s
    # step, "cost": Infinity, not JSON), an infinite rate can be blamed on --ttft-ms, a head size
    # can be floored in silence, and limits the engine refuses can be planned as fitting.
    (["serve", "--model", "llama-3-8b", "--gpu-memory-gib", "inf"], "--gpu-memory-gib"),
    (["serve", "--model", "llama-3-8b", "--gpu-memory-gib", "1e400"], "--gpu-memory-gib"),
    ([*TRAIN, "--peak-tflops", "inf"], "--peak-tflops"),
    ([*TRAIN, "--price-per-gpu-hour", "inf", "--peak-tflops", "989"], "--price-per-gpu-hour"),
    (["serve", "--slo", "--model", "llama-3-8b", "--gpu", "h100-sxm", "--request-rate", "inf", "--prompt-len", "1024",
      "--output-len", "256", "--ttft-ms", "500", "--tpot-ms", "40"], "--request-rate"),
    (["serve", "--hidden", "64", "--heads", "3", "--layers", "2", "--vocab", "100", "--gpu-memory-gib", "1"],
     "--heads"),
    (["serve", "--model", "llama-3-8b", "--gpu-memory-gib", "80", "--max-model-len", "100000"], "--max-model-len"),
    (["serve", "--model", "llama-3-8b", "--gpu-memory-gib", "80", "--block-size", "7"], "--block-size"),
    ([*TRAIN, "--lora-rank", "8", "--lora-targets", "q,embed_tokens"], "--lora-targets"),
    (["train", "--model", "gpt2", "--seq-len", "8", "--tokens", "8", "--lora-rank", "8", "--lora-targets", "gate"],
     "--lora-targets"),  # a GELU MLP has no gate projection
    ([*TRAIN, "--base-quantization", "nf4"], "--base-quantization"),  # QLoRA trains adapters: needs --lora-rank
    ([*TRAIN, "--lora-rank", "8", "--no-double-quant"], "--double-quant"),  # nf4's constants only
    ([*TRAIN, "--lora-rank", "8", "--lora-dropout", "1"], "--lora-dropout"),
    ([*TRAIN, "--lora-rank", "8", "--zero-accounting", "deepspeed"], "--zero-accounting"),
    (["serve", "--model", "llama-3-8b", "--gpu-memory-gib", "80", "--max-lora-rank", "16"], "--max-lora-rank"),
    # 13 GPUs for GPT-2 (12 heads, 12 layers) can only be 13 data-parallel replicas
    (["search", "--model", "gpt2", "--gpus-per-node", "13", "--gpu-memory-gib", "80", "--seq-len", "1024",
      "--global-batch", "3", "--tokens", "1e9"], "--global-batch"),
])
def test_nonsense_is_an_argparse_error_naming_the_flag(argv, flag):
    done = plan(*argv)
    assert done.returncode == 2
    assert flag in done.stderr.splitlines()[-1], done.stderr


def test_importing_planning_does_not_import_torch():
    code = "import sys, engine.planning, engine.planning.cli; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_sliding_window_limits_the_planned_context_as_the_engine_does(tmp_path):
    """A config whose sliding window is on is served (full attention) no longer than the window:
    engine/runner/model_runner.py's rule, which the plan used to skip (planned at max_position_embeddings)."""
    import json

    cfg = {"model_type": "mistral", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 512,
           "sliding_window": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = plan_json("serve", "--model", str(tmp_path), "--kv-cache-memory", "1MiB")
    assert out["max_model_len"] == 64
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": False}))
    assert plan_json("serve", "--model", str(tmp_path), "--kv-cache-memory", "1MiB")["max_model_len"] == 512
