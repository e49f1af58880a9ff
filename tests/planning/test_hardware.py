"""GPU presets, the communication-aware prediction, and the errors a user can cause with them."""


import pytest

from engine.planning.hardware import GPUS
from engine.planning.search import search_plans
from engine.planning.spec import ModelSpec
from engine.planning.steptime import Throughput
from engine.planning.units import GiB

from tests.planning.plan_cli import plan, plan_json

TRAIN = ["train", "--model", "llama-2-7b", "--seq-len", "4096", "--tokens", "1e9"]


@pytest.mark.parametrize("name, memory, bf16, fp8, hbm", [
    # datasheet figures, dense (half the sparse figure the datasheets print first)
    ("a100-80gb", 80, 312, None, 2.039), ("h100-sxm", 80, 989.5, 1979, 3.35), ("h100-pcie", 80, 756, 1513, 2.0),
    ("h200", 141, 989.5, 1979, 4.8), ("l40s", 48, 362.05, 733, 0.864), ("mi300x", 192, 1307.4, 2614.9, 5.3),
])
def test_presets_carry_the_datasheet_figures(name, memory, bf16, fp8, hbm):
    gpu = GPUS[name]
    assert (gpu.memory_gib, gpu.bf16_tflops, gpu.fp8_tflops, gpu.hbm_tbps) == (memory, bf16, fp8, hbm)


def test_gpu_preset_fills_every_figure_and_each_flag_overrides_its_own():
    out = plan_json(*TRAIN, "--gpu", "h100-sxm", "--gpus-per-node", "8")
    assert out["fits"] is not None and out["step"]["compute"] > 0 and not out["step"]["end_to_end"]
    assert out["cost"] == pytest.approx(out["gpu_hours"] * GPUS["h100-sxm"].price_per_gpu_hour)
    slow = plan_json(*TRAIN, "--gpu", "h100-sxm", "--gpus-per-node", "8", "--intra-node-gbps", "45")
    assert slow["step"]["communication"]["DP gradient sync"] == pytest.approx(
        10 * out["step"]["communication"]["DP gradient sync"])
    small = plan_json(*TRAIN, "--gpu", "h100-sxm", "--gpu-memory-gib", "10")
    assert small["fits"] is False


def test_unknown_gpu_lists_the_presets():
    done = plan(*TRAIN, "--gpu", "h1000")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--gpu" in done.stderr and all(name in done.stderr for name in GPUS)


@pytest.mark.parametrize("argv, flag, says", [
    ([*TRAIN, "--gpu", "h100-sxm", "--nodes", "2", "--gpus-per-node", "8", "--tp", "16"], "--tp", "by 8"),
    ([*TRAIN, "--gpu", "h100-sxm", "--gpus-per-node", "8", "--intra-node-gbps", "0"], "--intra-node-gbps",
     "positive bandwidth"),
    ([*TRAIN, "--peak-tflops", "989", "--gpus-per-node", "8"], "--intra-node-gbps", "DP gradient sync"),
    ([*TRAIN, "--gpus-per-node", "8", "--pp", "2", "--zero", "2"], "--zero", "pipeline"),
])
def test_hardware_and_layout_errors_say_what_failed(argv, flag, says):
    done = plan(*argv)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    last = done.stderr.splitlines()[-1]
    assert flag in last and says in last, done.stderr


def test_search_keeps_traffic_off_the_network_and_never_pairs_pp_with_zero_2_3():
    # Llama-2-70B on 8 x 8 H100s: ranked by predicted time, the best layouts keep TP in a node and do not
    # all-reduce every gradient over 32 replicas across nodes with ZeRO-3.
    spec = ModelSpec.from_preset("llama-2-70b")
    gpu = GPUS["h100-sxm"]
    result = search_plans(
        spec, nodes=8, gpus_per_node=8, gpu_memory_bytes=80 * GiB, seq_len=4096, global_batch=512, tokens=10**11,
        throughput=Throughput(peak=gpu.bf16_tflops * 1e12, intra_node_bw=gpu.intra_node_gbps * 1e9,
                              inter_node_bw=gpu.inter_node_gbps * 1e9),
    )
    assert result.excluded and all(not (p.layout.pp > 1 and p.layout.zero >= 2) for p in result.plans)
    best = result.plans[0]
    assert not (best.layout.zero == 3 and best.layout.dp >= 32)
    times = [p.time_s for p in result.plans]
    assert times == sorted(times)
    zero3_dp = [p for p in result.plans if p.layout.zero == 3 and p.layout.dp >= 32]
    assert zero3_dp and min(p.time_s for p in zero3_dp) > best.time_s


def test_explain_names_each_formula_and_its_source():
    done = plan(*TRAIN, "--gpu", "h100-sxm", "--gpus-per-node", "8", "--tp", "2", "--pp", "2", "--grad-accum", "4",
                "--explain")
    assert done.returncode == 0, done.stderr
    for source in ("Rajbhandari et al. 2020", "Korthikanti", "Kaplan et al. 2020", "2(N-1)/N", "Narayanan 2021",
                   "(p - 1) / m", "PaLM"):
        assert source in done.stdout, source


def test_chinchilla_hint_when_far_from_20_tokens_per_parameter():
    done = plan(*TRAIN)  # 1e9 tokens for 6.7B parameters
    assert "compute-optimal is about 20" in done.stdout
    done = plan("train", "--model", "llama-2-7b", "--seq-len", "4096", "--tokens", "1.4e11")
    assert "compute-optimal" not in done.stdout
