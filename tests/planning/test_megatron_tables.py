"""Megatron-LM's published weak-scaling tables, checked through `engine plan train`.

Both tables are images in the NVIDIA/Megatron-LM repository, read from its git history:
  2021, A100: images/cases_april2021.png, added by commit 50a4b5fa (2021-04-08) and shown by README.md until
    commit 2e90a342 (2022-05-19); the same rows as Narayanan et al. 2021, Table 1. GPT, V = 51,200, s = 2048.
  2024, H100: images/model_table.png, README.md since commit f2e5db40 (2024-07-15, "New scaling figures on H100
    GPUs"). GPT, V = 131,072, s = 4096; "MFU increases from 41% for the smallest model ... to 47-48%".
The tables give model shapes, layouts, batch and the achieved TFLOP/s; no step times. What the planner can be
checked on: each shape's parameter count against the table's, the layout arithmetic (DP, global batch), the
GPU preset's peak against the table's percentage of peak, and (2021) that every published layout fits an 80 GB
A100 by the planner's memory count.
"""

import json

import pytest

from engine.planning.cli import main


def plan(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# 2021: hidden, layers, parameters (billion, one decimal), model-parallel size, GPUs, batch, achieved TFLOP/s per GPU,
# percentage of peak, aggregate PFLOP/s. The table gives one model-parallel size: TP is 8 at most (a DGX A100's
# NVLink domain, §3.2), the rest PP, as the paper's Table 1 splits it (39B: 8 x 2, ..., 1T: 8 x 64).
MEGATRON_2021 = [
    (2304, 24, 1.7, 1, 32, 512, 137, 44, 4.4), (3072, 30, 3.6, 2, 64, 512, 138, 44, 8.8),
    (4096, 36, 7.5, 4, 128, 512, 142, 46, 18.2), (6144, 40, 18.4, 8, 256, 1024, 135, 43, 34.6),
    (8192, 48, 39.1, 16, 512, 1536, 138, 44, 70.8), (10240, 60, 76.1, 32, 1024, 1792, 140, 45, 143.8),
    (12288, 80, 145.6, 64, 1536, 2304, 148, 47, 227.1), (16384, 96, 310.1, 128, 1920, 2160, 155, 50, 297.4),
    (20480, 105, 529.6, 280, 2520, 2520, 163, 52, 410.2), (25600, 128, 1008.0, 512, 3072, 3072, 163, 52, 502.0),
]


@pytest.mark.parametrize("hidden, layers, billions, mp, gpus, batch, tflops, percent, petaflops", MEGATRON_2021,
                         ids=[f"{r[2]}B" for r in MEGATRON_2021])
def test_megatron_2021_weak_scaling_table(capsys, hidden, layers, billions, mp, gpus, batch, tflops, percent,
                                          petaflops):
    tp = min(mp, 8)
    # Narayanan eq. 2 counts the embedding once (GPT ties the LM head to it); heads enter no count
    out = plan(capsys, "train", "--arch", "gpt", "--layers", str(layers), "--hidden", str(hidden), "--heads",
               str(hidden // 128 if hidden % 128 == 0 else 24), "--vocab", "51200", "--max-positions", "2048",
               "--tie-embeddings", "--seq-len", "2048", "--tokens", str(batch * 2048), "--nodes", str(gpus // 8),
               "--gpus-per-node", "8", "--tp", str(tp), "--pp", str(mp // tp), "--micro-batch", "1",
               "--grad-accum", str(batch * mp // gpus), "--recompute", "full", "--attention", "eager",
               "--gpu", "a100-80gb", "--flops", "exact", "--achieved-tflops", str(tflops))
    assert abs(out["params"] / 1e9 - billions) <= 0.05  # the table's one decimal (1.652B prints as 1.7)
    assert out["layout"]["dp"] * mp == gpus and out["global_batch"] == batch
    # the a100-80gb preset's 312 TF is the table's peak; the per-GPU column is itself rounded to a whole TFLOP/s
    assert abs(100 * tflops / 312 - percent) <= 0.5 + 100 * 0.5 / 312
    assert abs(tflops * gpus / 1000 - petaflops) <= 0.5 * gpus / 1000 + 0.05
    # The layouts ran (full recomputation, mixed-precision Adam, no ZeRO): at the smallest micro-batch the planner
    # must find them within an 80 GB A100 (it does: 25-46 GiB)
    assert out["fits"], out["memory_per_gpu"]


# 2024: model size (the table's label), heads, hidden, layers, TP, PP, DP, GPUs, batch, per-GPU TFLOP/s, MFU (%),
# aggregate PFLOP/s.
MEGATRON_2024 = [
    (1.7, 16, 2048, 24, 1, 1, 48, 48, 192, 408.8, 41, 19.6), (7.1, 32, 4096, 30, 2, 1, 48, 96, 192, 465.9, 47, 44.7),
    (16, 48, 6144, 32, 4, 1, 48, 192, 192, 489.1, 49, 93.9), (32, 56, 7168, 48, 8, 1, 48, 384, 192, 459.6, 46, 176.5),
    (70, 64, 8192, 84, 8, 2, 48, 768, 384, 419.7, 42, 322.3),
    (119, 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5, 43, 645.9),
    (177, 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8, 44, 997.2),
    (314, 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4, 48, 1457.4),
    (462, 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9, 47, 2825.6),
]


@pytest.mark.parametrize("billions, heads, hidden, layers, tp, pp, dp, gpus, batch, tflops, mfu, petaflops",
                         MEGATRON_2024, ids=[f"{r[0]}B" for r in MEGATRON_2024])
def test_megatron_2024_h100_weak_scaling_table(capsys, billions, heads, hidden, layers, tp, pp, dp, gpus, batch,
                                               tflops, mfu, petaflops):
    # The README gives no MLP type or embedding tying. 12h^2 a layer holds for a GELU MLP of 4h and a SwiGLU one of
    # 8h/3 alike; the labels need untied embeddings (1.7B: 1.75B untied, 1.48B tied).
    out = plan(capsys, "train", "--arch", "gpt", "--layers", str(layers), "--hidden", str(hidden), "--heads",
               str(heads), "--vocab", "131072", "--max-positions", "4096", "--seq-len", "4096",
               "--tokens", str(batch * 4096), "--nodes", str(gpus // 8), "--gpus-per-node", "8", "--tp", str(tp),
               "--pp", str(pp), "--micro-batch", "1", "--grad-accum", str(batch // dp), "--gpu", "h100-sxm",
               "--flops", "exact", "--achieved-tflops", str(tflops))
    # The sizes are labels, not roundings of one count: 1.75B is "1.7B" and 31.5B is "32B" (a rotary, bias-free
    # variant gives 1.745B and 31.47B: no better). Within 3.5% of each label.
    assert out["params"] / 1e9 == pytest.approx(billions, rel=0.035)
    assert out["layout"]["dp"] == dp and out["global_batch"] == batch
    # MFU = TFLOP/s over the H100 SXM's dense BF16 peak: the preset's 989.5 TF gives the column to its rounding
    # (the README's own peak, by its 119B row's 42.50% -> "43%", is 989)
    assert abs(100 * tflops / 989.5 - mfu) <= 0.55
    assert abs(tflops * gpus / 1000 - petaflops) <= 0.05
