"""`engine plan serve --slo`: a plan that meets its targets, and a clear error when none can."""

import json

import pytest

from tests.planning.plan_cli import plan

SLO = ["serve", "--slo", "--model", "llama-3-70b", "--gpu", "h100-sxm", "--request-rate", "20", "--prompt-len",
       "512,1024,2048", "--output-len", "256"]


def test_plan_meets_its_targets_and_prints_the_engine_serve_command():
    done = plan(*SLO, "--ttft-ms", "1000", "--tpot-ms", "40")
    assert done.returncode == 0, done.stderr
    # a preset: the weights' folder is the user's to give
    assert 'engine serve --model "$MODEL"' in done.stdout and "--max-num-seqs" in done.stdout
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


def test_closed_loop_replays_the_scheduler_chunked_prefill_and_decodes_in_one_step():
    """32 prompts of 128 tokens under a 2,048-token budget, every step taking 1 s: 16 prompts prefill in step 1;
    step 2 decodes those 16 and prefills 2,032 tokens (15 prompts and 112 tokens of the last); step 3 decodes 31
    and finishes the last prompt; each request then decodes one token a step to its 64th."""
    from engine.planning.slo import Device, Workload, predict_closed_loop, simulate_wave
    from engine.planning.spec import ModelSpec

    spec = ModelSpec("t", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_size=128,
                     vocab_size=256)
    one_second = Device("steps of 1 s", None, flops=float("inf"), memory_bw=float("inf"), efficiency=1.0,
                        overlap=False, dense_curve=((1, 1.0), (4096, 1.0)),
                        head_curve=((1, 0.0), (32, 0.0)))
    first, last = simulate_wave(spec, one_second, 128, 64, 32, budget=2048, dtype_bytes=2, kv_dtype_bytes=2)
    assert first == [1.0] * 16 + [2.0] * 15 + [3.0]
    assert last == [64.0] * 16 + [65.0] * 15 + [66.0]
    p = predict_closed_loop(spec, one_second, Workload((128,), (64,)), 32, dtype_bytes=2, kv_dtype_bytes=2)
    assert p.ttft == (16 + 30 + 3) / 32 and p.tpot == 1.0 and p.throughput == 32 * 64 / 66
    # one request: its prefill, then 63 decode steps
    assert simulate_wave(spec, one_second, 128, 64, 1, budget=2048, dtype_bytes=2, kv_dtype_bytes=2) == ([1.0], [64.0])


@pytest.mark.serial  # the curves are timed once each on the spot: a parallel neighbour's load bends them
def test_cpu_device_is_measured_through_the_engine_kernels_and_predicts():
    pytest.importorskip("torch")
    from engine.planning.measure import measure_cpu
    from engine.planning.slo import Workload, predict_closed_loop
    from engine.planning.spec import ModelSpec

    spec = ModelSpec("t", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_size=128,
                     vocab_size=256)
    dev = measure_cpu(spec, "bfloat16", prompt=16, budget=64, kv_batch=4, kv_context=32, repeats=1)
    assert [r for r, _ in dev.dense_curve] == [1, 4, 8, 64] and [r for r, _ in dev.head_curve] == [1, 4]
    assert not dev.overlap and dev.kv_bw > 0 and dev.attention_flops > 0
    p = predict_closed_loop(spec, dev, Workload((16,), (8,)), 4, dtype_bytes=2, kv_dtype_bytes=2, budget=64)
    assert 0 < p.ttft < 1 and 0 < p.tpot < 1 and p.throughput > 0


@pytest.mark.parametrize("k, a, tokens", [(4, 0.0, 1.0), (4, 1.0, 5.0), (4, 0.5, 1.9375), (1, 0.8, 1.8)])
def test_speculation_yields_the_expected_accepted_length(k, a, tokens):
    """Leviathan et al. 2023, eq. 1: (1 - a^(k+1)) / (1 - a) tokens a verify step."""
    from engine.planning.slo import Speculation

    assert Speculation(k, a).tokens_per_step == pytest.approx(tokens)


def test_speculation_in_the_closed_loop_replay_and_the_roofline():
    from engine.planning.slo import (Device, Speculation, Workload, decode_step_seconds, predict_closed_loop,
                                     simulate_wave)
    from engine.planning.spec import ModelSpec

    spec = ModelSpec("t", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_size=128,
                     vocab_size=256)
    one_second = Device("steps of 1 s", None, flops=float("inf"), memory_bw=float("inf"), efficiency=1.0,
                        overlap=False, dense_curve=((1, 1.0), (4096, 1.0)), head_curve=((1, 0.0), (4096, 0.0)))
    # Every draft accepted (k = 3): the prompt's step gives the first token, then 4 tokens a step.
    first, last = simulate_wave(spec, one_second, 16, 65, 1, budget=2048, dtype_bytes=2, kv_dtype_bytes=2,
                                speculation=Speculation(3, 1.0))
    assert (first, last) == ([1.0], [17.0])
    p = predict_closed_loop(spec, one_second, Workload((16,), (65,)), 1, dtype_bytes=2, kv_dtype_bytes=2,
                            speculation=Speculation(3, 1.0))
    assert p.tpot == 16 / 64
    # A memory-bound step (batch 1 on a GPU) costs about the same verifying 4 drafts: speculation is worth
    # about its accepted length there, and nothing when no draft is accepted.
    from engine.planning.presets import PRESETS

    eight_b = ModelSpec.from_hf_config(PRESETS["llama-3-8b"])
    gpu = Device("gpu", 80 << 30, flops=1e15, memory_bw=3e12)
    plain = decode_step_seconds(eight_b, gpu, 1, 512, 2, 2)
    verify = decode_step_seconds(eight_b, gpu, 1, 512, 2, 2, speculation=Speculation(4, 0.8))
    assert plain <= verify < 1.05 * plain
    assert plain / (verify / Speculation(4, 0.8).tokens_per_step) == pytest.approx(3.36, rel=0.05)


def test_speculation_flags_come_in_pairs():
    done = plan(*SLO, "--ttft-ms", "1000", "--tpot-ms", "40", "--num-speculative-tokens", "4")
    assert done.returncode == 2 and "--acceptance-rate" in done.stderr.splitlines()[-1]
    done = plan(*SLO, "--ttft-ms", "1000", "--tpot-ms", "40", "--num-speculative-tokens", "4", "--acceptance-rate", "2")
    assert done.returncode == 2 and "probability" in done.stderr.splitlines()[-1]
    fast = json.loads(plan(*SLO, "--ttft-ms", "1000", "--tpot-ms", "40", "--num-speculative-tokens", "4",
                           "--acceptance-rate", "0.8", "--json").stdout)
    plain = json.loads(plan(*SLO, "--ttft-ms", "1000", "--tpot-ms", "40", "--json").stdout)
    assert fast["prediction"]["tpot"] < plain["prediction"]["tpot"]
