"""Published numbers, reproduced through the same code a user runs with `engine plan`."""

import json

import pytest

from engine.planning.cli import main
from engine.planning.flops import exact_flops
from engine.planning.memory import model_state_memory
from engine.planning.spec import ModelSpec
from engine.planning.units import MiB


def plan(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "zero, published_gb",
    [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)],
)
def test_zero_paper_figure_1(zero, published_gb):
    # Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, mixed-precision Adam (K = 12), N_d = 64.
    # The figure prints GB (1e9 bytes) to one decimal: tolerance 0.05 GB. Dimensions are any 7.5B
    # shape; --params pins the total as the paper does.
    spec = ModelSpec.from_preset("llama-2-7b").with_params(7_500_000_000)
    states = model_state_memory(spec, precision="mixed", optimizer="adamw", dp=64, zero=zero)
    total_gb = (states.weights + states.gradients + states.optimizer) / 1e9
    assert total_gb == pytest.approx(published_gb, abs=0.05)


KORTHIKANTI_TABLE_2 = [  # MiB per layer, GPT-3 175B, s = 2048, b = 1, t = 8
    ("no parallelism", [], 2736),
    ("tensor parallel", ["--tp", "8"], 552),
    ("tensor + sequence parallel", ["--tp", "8", "--sequence-parallel"], 342),
    ("tensor parallel + selective recompute", ["--tp", "8", "--recompute", "selective"], 312),
    ("tensor + sequence parallel + selective", ["--tp", "8", "--sequence-parallel", "--recompute", "selective"], 102),
    ("full recompute", ["--recompute", "full"], 48),
]


@pytest.mark.parametrize("case, flags, published_mib", KORTHIKANTI_TABLE_2, ids=[c[0] for c in KORTHIKANTI_TABLE_2])
def test_korthikanti_table_2_per_layer_activations(capsys, case, flags, published_mib):
    # Korthikanti et al. 2022, Table 2 evaluated at GPT-3 175B (h 12288, a 96, fp16, dropout, eager
    # attention). Tolerance 0.05 MiB: the count also keeps LayerNorm's fp32 mean and rstd per token
    # (2 x 8 bytes x 2048 tokens = 0.03 MiB), which the paper leaves out.
    gpus = "8" if "--tp" in flags else "1"
    out = plan(
        capsys, "train", "--model", "gpt3-175b", "--seq-len", "2048", "--micro-batch", "1", "--attention", "eager",
        "--dtype", "float16", "--gpus-per-node", gpus, "--tokens", "2048", *flags,
    )
    assert out["activations_per_layer"] / MiB == pytest.approx(published_mib, abs=0.05)


def test_training_time_6nd_at_peak_and_8nd_at_achieved(capsys):
    # 8.2e10 parameters, 1.5e11 tokens, 1024 A100s: 6ND at 312 TFLOP/s peak = 2.67 days;
    # 8ND (full recomputation) at 68 TFLOP/s achieved = 16.4 days. Tolerance: the published rounding.
    common = ["train", "--model", "llama-2-70b", "--params", "8.2e10", "--tokens", "1.5e11", "--seq-len", "2048",
              "--nodes", "128", "--gpus-per-node", "8"]
    at_peak = plan(capsys, *common, "--peak-tflops", "312", "--mfu", "1")
    assert at_peak["flops"] == pytest.approx(6 * 8.2e10 * 1.5e11)
    assert at_peak["time_s"] / 86400 == pytest.approx(2.67, abs=0.005)
    achieved = plan(capsys, *common, "--recompute", "full", "--achieved-tflops", "68")
    assert achieved["flops"] == pytest.approx(8 * 8.2e10 * 1.5e11)
    assert achieved["time_s"] / 86400 == pytest.approx(16.4, abs=0.05)


def test_global_batch_and_steps_per_epoch(capsys):
    # 1,000 samples, micro batch 10, 2 accumulation steps, 1 GPU: global batch 20, 50 steps an epoch.
    common = ["train", "--model", "gpt2", "--seq-len", "1024", "--samples", "1000", "--micro-batch", "10",
              "--grad-accum", "2"]
    out = plan(capsys, *common)
    assert (out["global_batch"], out["steps"]) == (20, 50)
    assert plan(capsys, *common, "--epochs", "3")["steps"] == 150


def test_exact_flops_equal_narayanan_formula_for_gpt3():
    # Narayanan et al. 2021, §5.1: with full recomputation a GPT step costs
    # 96 B s l h^2 (1 + s / 6h + V / 16lh) FLOPs, l the layer count. Exact for a GPT layer (no biases or norms counted).
    spec = ModelSpec.from_preset("gpt3-175b")
    B, s, layers, h, V = 1536, 2048, 96, 12288, 50257
    published = 96 * B * s * layers * h**2 * (1 + s / (6 * h) + V / (16 * layers * h))
    assert exact_flops(spec, s, B * s, recompute="full") == pytest.approx(published, rel=1e-12)


HF_HUB_PARAMS = {  # parameter counts of the Hugging Face checkpoints (safetensors metadata)
    "gpt2": 124_439_808,
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "mistral-7b": 7_241_732_096,
}


@pytest.mark.parametrize("name, published", HF_HUB_PARAMS.items())
def test_preset_parameter_counts(name, published):
    assert ModelSpec.from_preset(name).params == published  # exact


def test_gpt3_is_175b():
    # Brown et al. 2020, Table 2.1 reports 175.0B; the GPT-2 architecture at that shape has 174.6B.
    assert ModelSpec.from_preset("gpt3-175b").params == pytest.approx(175e9, rel=0.005)
