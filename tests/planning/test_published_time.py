"""Training time against published tables, through `engine plan train` as a user runs it.

An end-to-end figure (achieved TFLOP/s, MFU) reproduces the published time with nothing added: the
bubble and the communication are already in it. Tolerance 10% (the issue's bar); observed within 3%.
"""

import json

import pytest

from engine.planning.cli import main


def plan(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def gpt(layers, hidden, heads):
    # Megatron-LM pads GPT's vocabulary to 51,200 (Narayanan et al. 2021 and Korthikanti et al. 2022 use V = 51200)
    return ["--arch", "gpt", "--layers", str(layers), "--hidden", str(hidden), "--heads", str(heads),
            "--vocab", "51200", "--max-positions", "2048"]


# Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters", Table 2 (PTD-P rows):
# GPUs, achieved TFLOP/s per GPU, days to train on 300B tokens. Batch 1536 (175B) and 2240 (530B).
NARAYANAN_TABLE_2 = [
    ("175B", gpt(96, 12288, 96), 1536, 384, 153, 84), ("175B", gpt(96, 12288, 96), 1536, 768, 149, 43),
    ("175B", gpt(96, 12288, 96), 1536, 1536, 141, 23), ("530B", gpt(105, 20480, 128), 2240, 560, 171, 156),
    ("530B", gpt(105, 20480, 128), 2240, 1120, 167, 80), ("530B", gpt(105, 20480, 128), 2240, 2240, 159, 42),
]


@pytest.mark.parametrize("name, model, batch, gpus, tflops, days", NARAYANAN_TABLE_2,
                         ids=[f"{r[0]}-{r[3]}gpus" for r in NARAYANAN_TABLE_2])
def test_narayanan_table_2_ptd_p_training_days(capsys, name, model, batch, gpus, tflops, days):
    # Their FLOPs count full recomputation (eq. 3); TP 8 within a node, the rest as DP (the time does not
    # depend on the split: an end-to-end rate).
    out = plan(capsys, "train", *model, "--seq-len", "2048", "--tokens", "3e11", "--nodes", str(gpus // 8),
               "--gpus-per-node", "8", "--tp", "8", "--micro-batch", "1", "--grad-accum", str(batch * 8 // gpus),
               "--recompute", "full", "--flops", "exact", "--achieved-tflops", str(tflops))
    assert out["time_s"] / 86400 == pytest.approx(days, rel=0.10)
    assert out["step"]["end_to_end"] and out["step"]["bubble"] == 0


# Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models": Table 3's
# configurations (TP 8, PP, GPUs = global batch, micro-batch 1, s = 2048) and Table 5's iteration time with
# sequence parallelism + selective recomputation, from its stated model FLOPs utilization on A100 (312 TF).
KORTHIKANTI = [
    ("22B", gpt(48, 6144, 64), 1, 8, 4, 0.415, 1.10),
    ("175B", gpt(96, 12288, 96), 8, 64, 64, 0.514, 13.75),
    ("530B", gpt(105, 20480, 128), 35, 280, 280, 0.560, 37.83),
    ("1T", gpt(128, 25600, 160), 64, 512, 512, 0.563, 71.49),
]


@pytest.mark.parametrize("name, model, pp, gpus, batch, mfu, seconds", KORTHIKANTI, ids=[r[0] for r in KORTHIKANTI])
def test_korthikanti_iteration_time_from_mfu(capsys, name, model, pp, gpus, batch, mfu, seconds):
    out = plan(capsys, "train", *model, "--seq-len", "2048", "--tokens", str(batch * 2048), "--nodes", str(gpus // 8),
               "--gpus-per-node", "8", "--tp", "8", "--pp", str(pp), "--sequence-parallel", "--recompute", "selective",
               "--micro-batch", "1", "--grad-accum", str(batch * 8 * pp // gpus), "--flops", "exact",
               "--gpu", "a100-80gb", "--mfu", str(mfu))
    assert out["steps"] == 1
    assert out["time_s"] == pytest.approx(seconds, rel=0.10)
    assert out["mfu"] == pytest.approx(mfu, rel=1e-9)  # MFU is on model FLOPs; HFU adds the recomputed attention
    assert out["hfu"] > out["mfu"]


# The Llama 2 paper (Touvron et al. 2023b, Table 2) and model card give A100-80GB GPU-hours for 2T tokens at 4k
# context and state no throughput. The nearest stated one: LLaMA 1 (Touvron et al. 2023a, §2.4), the same team on
# the same GPU: "when training a 65B-parameter model, our code processes around 380 tokens/sec/GPU on 2048 A100
# GPU with 80GB of RAM" (2k context; its Table 15's 1,022,362 GPU-hours for 1.4T tokens agree: 380 tokens/s).
LLAMA_2_CARD = (("llama-2-7b", 184_320), ("llama-2-13b", 368_640), ("llama-2-70b", 1_720_320))
LLAMA_65B = ["--layers", "80", "--hidden", "8192", "--heads", "64", "--ffn-hidden", "22016", "--vocab", "32000",
             "--max-positions", "2048"]
LLAMA_2 = ["--seq-len", "4096", "--tokens", "2e12", "--nodes", "128", "--gpus-per-node", "8", "--tp", "8",
           "--micro-batch", "1", "--grad-accum", "8", "--flops", "exact", "--gpu", "a100-80gb"]


def test_llama_2_model_card_gpu_hours_from_llama_1_stated_throughput(capsys):
    """LLaMA 65B's stated 380 tokens/s/GPU is an MFU (exact count, 2k context) of 49.5% on the A100's 312 TF;
    Llama 2 at that MFU: 70B 1.60M GPU-hours, 7% under the card's 1.72M (within the 10% bar). 7B and 13B
    come out 10.0% and 14.9% under: the card's smaller models ran below LLaMA 65B's rate (42-46% MFU by
    this count), and no source states their rate, so for them the check stays a miss, recorded here."""
    one = plan(capsys, "train", *LLAMA_65B, "--seq-len", "2048", "--tokens", "1", "--flops", "exact",
               "--gpu", "a100-80gb", "--mfu", "1")
    mfu = one["flops"] * 380 / 312e12  # FLOPs of one token x tokens per second per GPU over the A100's bf16 peak
    assert mfu == pytest.approx(0.495, abs=0.001)
    under = {}
    for name, gpu_hours in LLAMA_2_CARD:
        out = plan(capsys, "train", "--model", name, *LLAMA_2, "--mfu", f"{mfu:.6f}")
        under[name] = out["gpu_hours"] / gpu_hours - 1
    assert under["llama-2-70b"] == pytest.approx(-0.070, abs=0.005)  # within 10%: the stated basis holds for 70B
    assert under["llama-2-7b"] == pytest.approx(-0.100, abs=0.005)  # at the bar's edge
    assert under["llama-2-13b"] == pytest.approx(-0.149, abs=0.005)  # outside it


def test_llama_2_model_card_gpu_hours_at_one_assumed_mfu(capsys):
    """No stated throughput: the check is against an assumed MFU. One MFU for all three, 40% on 6ND (an
    assumption, not a published figure), reproduces each within 10%: it shows the card's figures scale as
    6ND at a common efficiency, not that the planner predicts them."""
    for name, gpu_hours in LLAMA_2_CARD:
        out = plan(capsys, "train", "--model", name, "--seq-len", "4096", "--tokens", "2e12", "--nodes", "128",
                   "--gpus-per-node", "8", "--tp", "8", "--micro-batch", "1", "--grad-accum", "8",
                   "--gpu", "a100-80gb", "--mfu", "0.4")
        assert out["gpu_hours"] == pytest.approx(gpu_hours, rel=0.10), name


def test_micro_steps_and_gpu_hours_and_cost(capsys):
    # 1,000 samples, micro-batch 10, accumulation 2, 1 GPU: 50 optimizer steps of 2 micro-batches = 100 micro-steps
    out = plan(capsys, "train", "--model", "gpt2", "--seq-len", "1024", "--samples", "1000", "--micro-batch", "10",
               "--grad-accum", "2", "--time-per-step", "3.6", "--price-per-gpu-hour", "2", "--gpu", "h100-sxm")
    assert (out["steps"], out["micro_steps"], out["tokens_per_step"]) == (50, 100, 20 * 1024)
    assert out["gpu_hours"] == pytest.approx(50 * 3.6 / 3600) and out["cost"] == pytest.approx(2 * out["gpu_hours"])
