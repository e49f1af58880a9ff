"""Training time against published tables, through `engine plan train` as a user runs it.

An end-to-end figure (achieved TFLOP/s, MFU) reproduces the published time with nothing added: the
bubble and the communication are already in it. Tolerance 10% (the planner's bar); observed within 1.2%.

Where each figure was read (re-read for this file, not written from memory):
  Narayanan et al. 2021 (arXiv 2104.04473), Table 2: the table itself as a screenshot in cli99/llm-analysis,
    figures/megatron-lm-2nd-table-2.png (commit d841e40a, 2024-11-13).
  Narayanan et al. 2021 §5.1, the training-time estimates of its text (34 days, 84 days): only through two
    independent public reading notes that quote them; the paper's text was not found in a stored copy.
  Korthikanti et al. 2022 (arXiv 2205.05198): MFU and HFU, NVIDIA/Megatron-LM README.md at commit 2e90a342
    (2022-05-19, "measured using a data parallel size of one"); the abstract's 54.2% / 42.1% on 2240 GPUs; Table 3
    (configurations) and Table 5 (iteration times) through public reading notes that transcribe them, whose MFU
    and HFU columns equal the README's.
  LLaMA (Touvron et al. 2023a, arXiv 2302.13971): Table 2 (sizes, tokens) and Table 15 (GPU-hours) as screenshots
    in cli99/llm-analysis figures/llama-table-2.png and llama-table-15.png; §2.4's 380 tokens/s/GPU as quoted in
    several public notes (and equal to Table 15's 65B row, tested below).
  Llama 2 GPU-hours: meta-llama/llama MODEL_CARD.md (commit 0e3444bc).
"""

import json

import pytest

from engine.planning.cli import main


def plan(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def gpt(layers, hidden, heads):
    # Megatron-LM pads GPT's vocabulary to 51,200 (Narayanan et al. 2021 §5.1, Korthikanti et al. 2022 §5: V = 51200);
    # heads enter neither the parameter count nor the FLOPs (eq. 2, eq. 3)
    return ["--arch", "gpt", "--layers", str(layers), "--hidden", str(hidden), "--heads", str(heads),
            "--vocab", "51200", "--max-positions", "2048"]


GPT3_175B, MT_NLG_530B = gpt(96, 12288, 96), gpt(105, 20480, 128)
# Narayanan et al. 2021, Table 2: scheme, model, batch, GPUs, micro-batch, achieved TFLOP/s per GPU, days for 300B
# tokens. PTD-P: model-parallel size 96 (175B) and 280 (530B); ZeRO-3 without model parallelism (the 640-GPU row
# starred in the paper: batch 2560, the only one that fit).
NARAYANAN_TABLE_2 = [
    ("PTD-P", "175B", GPT3_175B, 1536, 384, 1, 153, 84), ("PTD-P", "175B", GPT3_175B, 1536, 768, 1, 149, 43),
    ("PTD-P", "175B", GPT3_175B, 1536, 1536, 1, 141, 23), ("PTD-P", "530B", MT_NLG_530B, 2240, 560, 1, 171, 156),
    ("PTD-P", "530B", MT_NLG_530B, 2240, 1120, 1, 167, 80), ("PTD-P", "530B", MT_NLG_530B, 2240, 2240, 1, 159, 42),
    ("ZeRO-3", "175B", GPT3_175B, 1536, 384, 4, 144, 90), ("ZeRO-3", "175B", GPT3_175B, 1536, 768, 2, 88, 74),
    ("ZeRO-3", "175B", GPT3_175B, 1536, 1536, 1, 44, 74), ("ZeRO-3", "530B", MT_NLG_530B, 2560, 640, 4, 138, 169),
    ("ZeRO-3", "530B", MT_NLG_530B, 2240, 1120, 2, 98, 137), ("ZeRO-3", "530B", MT_NLG_530B, 2240, 2240, 1, 48, 140),
]


@pytest.mark.parametrize("scheme, name, model, batch, gpus, micro, tflops, days", NARAYANAN_TABLE_2,
                         ids=[f"{r[0]}-{r[1]}-{r[4]}gpus" for r in NARAYANAN_TABLE_2])
def test_narayanan_table_2_training_days(capsys, scheme, name, model, batch, gpus, micro, tflops, days):
    # Their FLOPs count full recomputation (eq. 3). The time at an end-to-end rate does not depend on the split:
    # PTD-P as TP 8 within a node and the rest DP, ZeRO-3 as the paper ran it, every GPU a DP rank.
    layout = (["--tp", "8", "--grad-accum", str(batch * 8 // gpus)] if scheme == "PTD-P"
              else ["--zero", "3", "--grad-accum", str(batch // (gpus * micro))])
    out = plan(capsys, "train", *model, "--seq-len", "2048", "--tokens", "3e11", "--nodes", str(gpus // 8),
               "--gpus-per-node", "8", "--micro-batch", str(micro), *layout, "--recompute", "full",
               "--flops", "exact", "--achieved-tflops", str(tflops))
    assert out["global_batch"] == batch
    assert out["time_s"] / 86400 == pytest.approx(days, rel=0.10)
    assert out["time_s"] / 86400 == pytest.approx(days, rel=0.015)  # observed: within 1.2% (the days are rounded)
    assert out["step"]["end_to_end"] and out["step"]["bubble"] == 0


@pytest.mark.parametrize("model, params, tokens, gpus, tflops, days", [
    # §5.1: GPT-3 175B (174.6B) on 1,024 A100s at 140 TFLOP/s, 300B tokens: "about 34 days"; the 1T model (1,008B,
    # Table 1: 128 layers, hidden 25600) on 3,072 A100s at 163 TFLOP/s, 450B tokens: "about 84 days". Both are
    # eq. 4, 8TP / (nX): 33.8 and 83.9 days.
    (GPT3_175B, 174.6e9, 3e11, 1024, 140, 34),
    (gpt(128, 25600, 160), 1008.0e9, 4.5e11, 3072, 163, 84),
], ids=["175B-1024gpus", "1T-3072gpus"])
def test_narayanan_text_training_time_estimates(capsys, model, params, tokens, gpus, tflops, days):
    common = ["train", *model, "--seq-len", "2048", "--tokens", str(int(tokens)), "--nodes", str(gpus // 8),
              "--gpus-per-node", "8", "--tp", "8", "--recompute", "full", "--achieved-tflops", str(tflops)]
    by_8nd = plan(capsys, *common, "--params", str(int(params)))  # eq. 4 exactly: 8ND at X
    assert by_8nd["time_s"] / 86400 == pytest.approx(8 * tokens * params / (gpus * tflops * 1e12) / 86400)
    assert by_8nd["time_s"] / 86400 == pytest.approx(days, rel=0.02)
    # the exact count adds attention (s / 6h) and the logits (V / 16lh): 2.4% (175B) and 1.1% (1T) more
    exact = plan(capsys, *common, "--flops", "exact")
    assert exact["time_s"] / 86400 == pytest.approx(days, rel=0.03)


# Korthikanti et al. 2022, Table 3's configurations (TP 8, PP, GPUs = global batch but 22B's 4, micro-batch 1 but
# 22B's 4, s = 2048), sequence parallelism + selective recomputation; Table 5's iteration time ("present work"),
# MFU and HFU on A100 (312 TFLOP/s). MFU / HFU: the Megatron-LM README's table, the same numbers.
KORTHIKANTI = [
    ("22B", gpt(48, 6144, 64), 1, 8, 4, 0.415, 0.437, 1.10),
    ("175B", GPT3_175B, 8, 64, 64, 0.514, 0.528, 13.75),
    ("530B", MT_NLG_530B, 35, 280, 280, 0.560, 0.570, 37.83),
    ("1T", gpt(128, 25600, 160), 64, 512, 512, 0.563, 0.570, 71.49),
]


@pytest.mark.parametrize("name, model, pp, gpus, batch, mfu, hfu, seconds", KORTHIKANTI,
                         ids=[r[0] for r in KORTHIKANTI])
def test_korthikanti_iteration_time_from_mfu(capsys, name, model, pp, gpus, batch, mfu, hfu, seconds):
    out = plan(capsys, "train", *model, "--seq-len", "2048", "--tokens", str(batch * 2048), "--nodes", str(gpus // 8),
               "--gpus-per-node", "8", "--tp", "8", "--pp", str(pp), "--sequence-parallel", "--recompute", "selective",
               "--micro-batch", "1", "--grad-accum", str(batch * 8 * pp // gpus), "--flops", "exact",
               "--gpu", "a100-80gb", "--mfu", str(mfu))
    assert out["steps"] == 1
    assert out["time_s"] == pytest.approx(seconds, rel=0.10)
    assert out["time_s"] == pytest.approx(seconds, rel=0.005)  # observed: within 0.4% (their model FLOPs are ours)
    assert out["mfu"] == pytest.approx(mfu, rel=1e-9)  # MFU is on model FLOPs; HFU adds the recomputed attention
    # The paper's HFU counts selective recomputation as 72BLsh^2 x s/6h more FLOPs (its appendix: 1 + s/3h
    # against MFU's 1 + s/6h), three times the forward of the attention scores the planner counts (4 s^2 h a layer
    # and sample: QK^T and AV again). The planner's HFU is therefore lower: by 3.4% (22B) to 0.8% (1T).
    assert hfu * 0.96 < out["hfu"] < hfu


def test_korthikanti_530b_on_2240_gpus_abstract(capsys):
    """The abstract: 530B on 2,240 A100s reaches 54.2% MFU with the paper's method, "29% faster than the 42.1%"
    with full recomputation. At those MFUs the planner's step times differ by 54.2 / 42.1 (the ratio, exactly),
    and full recomputation's HFU (the forward counted twice) is near the selective run's."""
    common = ["train", *MT_NLG_530B, "--seq-len", "2048", "--tokens", str(2240 * 2048), "--nodes", "280",
              "--gpus-per-node", "8", "--tp", "8", "--pp", "35", "--sequence-parallel", "--micro-batch", "1",
              "--grad-accum", "280", "--flops", "exact", "--gpu", "a100-80gb"]
    present = plan(capsys, *common, "--recompute", "selective", "--mfu", "0.542")
    full = plan(capsys, *common, "--recompute", "full", "--mfu", "0.421")
    assert full["time_s"] / present["time_s"] == pytest.approx(0.542 / 0.421)
    assert full["time_s"] / present["time_s"] - 1 == pytest.approx(0.29, abs=0.005)  # "29% faster"
    assert full["hfu"] == pytest.approx(0.421 * 4 / 3, rel=0.02)  # 8ND over 6ND, less the logits' share


# LLaMA (Touvron et al. 2023a): Table 2's training tokens and Table 15's A100-80GB GPU-hours, with the architectures
# (dimension, heads, layers from Table 2; MLP widths from the released checkpoints' configs: 11008, 13824, 22016).
# LLaMA-1 7B and 13B have the shapes of Llama 2 7B and 13B (the presets), 2k context instead of 4k.
LLAMA_1 = {
    "7B": (["--model", "llama-2-7b"], 1.0e12, 82_432),
    "13B": (["--model", "llama-2-13b"], 1.0e12, 135_168),
    "65B": (["--layers", "80", "--hidden", "8192", "--heads", "64", "--ffn-hidden", "22016", "--vocab", "32000"],
            1.4e12, 1_022_362),
}
# Llama 2 model card (MODEL_CARD.md): A100-80GB GPU-hours of pretraining on 2T tokens at 4k context. Each is a whole
# number of hours on 2,048 GPUs (90, 180 and 840 h): time booked, not compute measured.
LLAMA_2_CARD = {"llama-2-7b": 184_320, "llama-2-13b": 368_640, "llama-2-70b": 1_720_320}
LLAMA_2 = ["--seq-len", "4096", "--tokens", "2e12", "--nodes", "128", "--gpus-per-node", "8", "--tp", "8",
           "--micro-batch", "1", "--grad-accum", "8", "--flops", "exact", "--gpu", "a100-80gb"]


def llama_1_mfu(capsys, size: str) -> float:
    """LLaMA-1's MFU at that size: its tokens per GPU-second (Table 2 over Table 15) x the planner's FLOPs of a
    token at its 2k context (attention over the full s x s, as the planner counts it) over the A100's 312 TF."""
    model, tokens, gpu_hours = LLAMA_1[size]
    one = plan(capsys, "train", *model, "--seq-len", "2048", "--tokens", "1", "--flops", "exact", "--gpu",
               "a100-80gb", "--mfu", "1")
    return one["flops"] * tokens / (gpu_hours * 3600) / 312e12


def llama_2_gpu_hours(capsys, name: str, mfu: float) -> float:
    return plan(capsys, "train", "--model", name, *LLAMA_2, "--mfu", f"{mfu:.6f}")["gpu_hours"]


def test_llama_1_stated_throughput_is_its_table_15():
    # §2.4: "when training a 65B-parameter model, our code processes around 380 tokens/sec/GPU on 2048 A100 GPU with
    # 80GB of RAM"; Table 15: 1,022,362 GPU-hours for its 1.4T tokens, i.e. 380.4 tokens/s/GPU
    _, tokens, gpu_hours = LLAMA_1["65B"]
    assert tokens / (gpu_hours * 3600) == pytest.approx(380, abs=0.5)


def test_llama_2_model_card_gpu_hours_from_llama_1_at_the_same_size(capsys):
    """The sourced input: LLaMA-1's own rate at each size (Table 15), as an MFU by the planner's count (7B 46.3%,
    13B 54.1%, 65B 49.5%), applied to Llama 2 at 4k context (the attention FLOPs of 4k included) on the same A100s.
    7B comes out 3.8% under the card and 70B (from 65B) 7.1% under: within 10%. 13B does not: 22.2% under. The card's
    13B took twice the 7B's hours (368,640 = 2 x 184,320) where LLaMA-1 13B took 1.64x LLaMA-1 7B's per token; no
    published figure accounts for the difference, and no sourced rate brings all three within 10%."""
    pairs = {"llama-2-7b": "7B", "llama-2-13b": "13B", "llama-2-70b": "65B"}
    mfu = {size: llama_1_mfu(capsys, size) for size in set(pairs.values())}
    assert (round(mfu["7B"], 3), round(mfu["13B"], 3), round(mfu["65B"], 3)) == (0.463, 0.541, 0.495)
    off = {name: llama_2_gpu_hours(capsys, name, mfu[size]) / LLAMA_2_CARD[name] - 1 for name, size in pairs.items()}
    assert abs(off["llama-2-7b"]) <= 0.10 and abs(off["llama-2-70b"]) <= 0.10  # what holds
    assert off["llama-2-7b"] == pytest.approx(-0.038, abs=0.003)
    assert off["llama-2-70b"] == pytest.approx(-0.071, abs=0.003)
    assert off["llama-2-13b"] == pytest.approx(-0.222, abs=0.003)  # the miss, recorded


def test_llama_2_model_card_gpu_hours_from_llama_65b_stated_throughput(capsys):
    """The one rate LLaMA states in its text (65B, 380 tokens/s/GPU = 49.5% MFU by the planner's count) applied to all
    three: 70B 7.1% under the card (within 10%); 7B 10.1% and 13B 15.0% under (outside)."""
    mfu = llama_1_mfu(capsys, "65B")
    assert mfu == pytest.approx(0.495, abs=0.001)
    off = {name: llama_2_gpu_hours(capsys, name, mfu) / hours - 1 for name, hours in LLAMA_2_CARD.items()}
    assert off["llama-2-70b"] == pytest.approx(-0.071, abs=0.003)
    assert off["llama-2-7b"] == pytest.approx(-0.101, abs=0.003)
    assert off["llama-2-13b"] == pytest.approx(-0.150, abs=0.003)


def test_llama_2_model_card_gpu_hours_from_one_row_predict_the_other_two(capsys):
    """Llama 2's own throughput is published only through the card's hours, so each row in turn gives the MFU of
    that training setup (same cluster, code and context; 7B 44.5%, 13B 42.1%, 70B 46.0% by the planner's count)
    and the planner, held at it, predicts the other two sizes: all six predictions within 10% (the largest 9.3%,
    70B from 13B). This tests what the planner adds to a published rate, how the FLOPs of a token scale with the
    model at 4k context; the LLaMA-1 rates above are an outside input and miss 13B."""
    one = {name: llama_2_gpu_hours(capsys, name, 1.0) for name in LLAMA_2_CARD}  # hours at 100% MFU
    mfu = {name: one[name] / hours for name, hours in LLAMA_2_CARD.items()}
    assert (round(mfu["llama-2-7b"], 3), round(mfu["llama-2-13b"], 3), round(mfu["llama-2-70b"], 3)) == \
        (0.445, 0.421, 0.460)
    for source in LLAMA_2_CARD:
        for name, hours in LLAMA_2_CARD.items():
            predicted = llama_2_gpu_hours(capsys, name, mfu[source])
            assert abs(predicted / hours - 1) <= (0.0005 if name == source else 0.10), (source, name)
    assert llama_2_gpu_hours(capsys, "llama-2-70b", mfu["llama-2-13b"]) / LLAMA_2_CARD["llama-2-70b"] - 1 == \
        pytest.approx(0.093, abs=0.003)


def test_micro_steps_and_gpu_hours_and_cost(capsys):
    # 1,000 samples, micro-batch 10, accumulation 2, 1 GPU: 50 optimizer steps of 2 micro-batches = 100 micro-steps
    out = plan(capsys, "train", "--model", "gpt2", "--seq-len", "1024", "--samples", "1000", "--micro-batch", "10",
               "--grad-accum", "2", "--time-per-step", "3.6", "--price-per-gpu-hour", "2", "--gpu", "h100-sxm")
    assert (out["steps"], out["micro_steps"], out["tokens_per_step"]) == (50, 100, 20 * 1024)
    assert out["gpu_hours"] == pytest.approx(50 * 3.6 / 3600) and out["cost"] == pytest.approx(2 * out["gpu_hours"])
