"""LoRA and QLoRA memory against the papers' own figures, through `engine plan train` as a user runs it.

Sources:
  QLoRA: Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs", arXiv:2305.14314.
  LoRA:  Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685.
Two figures of these papers are not used, because the text does not say what they count: QLoRA §2's "the
4-bit base model consumes 5,048 MB" for LLaMA 7B (its NF4 + double-quantized linear layers and 16-bit
embeddings come to 3,866 MB; the rest is not itemized), and LoRA §4.2's 1.2 TB for full fine-tuning of GPT-3
175B (between 1.05 TB, 16-bit weights and Adam moments, and 1.4 TB with the gradients too).
"""

import json

import pytest

from engine.planning.cli import main
from engine.planning.lora import NF4, NF4_DOUBLE_QUANT
from engine.planning.units import GiB

# The Guanaco 65B recipe: artidoro/qlora scripts/finetune_guanaco_65b.sh (--lora_r 64 --lora_alpha 16
# --lora_modules all --double_quant --quant_type nf4 --bf16 --gradient_checkpointing
# --per_device_train_batch_size 4 --gradient_accumulation_steps 4 --target_max_len 512 --lora_dropout 0.05),
# with qlora.py's defaults: optim paged_adamw_32bit (float32 states) and the LoRA layers cast to bfloat16.
QLORA_65B = ["train", "--model", "llama-65b", "--seq-len", "512", "--micro-batch", "4", "--grad-accum", "4",
             "--tokens", "1e7", "--recompute", "full", "--dtype", "bf16", "--optimizer", "adamw32bit",
             "--lora-rank", "64", "--lora-alpha", "16", "--lora-targets", "all-linear", "--lora-dropout", "0.05",
             "--base-quantization", "nf4"]


def plan(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_nf4_constants_cost_half_a_bit_and_0127_with_double_quantization():
    # QLoRA §3, Double Quantization: "for a blocksize of 64, this quantization reduces the memory footprint
    # per parameter from 32/64 = 0.5 bits, to 8/64 + 32/(64 x 256) = 0.127 bits". Exact.
    assert NF4.bits_per_weight - 4 == 32 / 64
    assert NF4_DOUBLE_QUANT.bits_per_weight - 4 == 8 / 64 + 32 / (64 * 256)
    assert round(NF4_DOUBLE_QUANT.bits_per_weight - 4, 3) == 0.127


def test_double_quantization_saves_about_3_gb_on_llama_65b(capsys):
    # QLoRA §1: Double Quantization saves "an average of about 0.37 bits per parameter (approximately 3 GB
    # for a 65B model)". Within 10%.
    with_dq = plan(capsys, *QLORA_65B)["lora"]["frozen_weights_per_gpu"]
    without = plan(capsys, *QLORA_65B, "--no-double-quant")["lora"]["frozen_weights_per_gpu"]
    assert without - with_dq == pytest.approx(3e9, rel=0.10)


def test_qlora_finetunes_llama_65b_on_one_48gb_gpu(capsys):
    # QLoRA Abstract and §1: QLoRA "reduces the average memory requirements of finetuning a 65B parameter
    # model from >780GB of GPU memory to <48GB", "on a single 48GB GPU" (an RTX A6000 / A40: 48 GiB). The
    # claim is a bound: the plan must fit under it and come within 10% of it, so that nothing large is left
    # out. The frozen base, in NF4 with double quantization, is most of it.
    out = plan(capsys, *QLORA_65B, "--gpu-memory-gib", "48")
    total = out["memory_per_gpu"]["total"]
    assert out["fits"] and 0.9 * 48 * GiB <= total <= 48 * GiB
    assert out["lora"]["frozen_weights_per_gpu"] > 0.7 * total


def test_16_bit_full_finetuning_of_llama_65b_needs_over_780_gb(capsys):
    # QLoRA §1: "regular 16-bit finetuning of a LLaMA 65B parameter model requires more than 780 GB of GPU
    # memory": 16-bit weights and gradients and 32-bit Adam moments, 12 bytes a parameter. Within 10%.
    mem = plan(capsys, "train", "--model", "llama-65b", "--seq-len", "512", "--tokens", "1e7", "--dtype", "bf16",
               "--optimizer", "adamw32bit", "--recompute", "full")["memory_per_gpu"]
    states = mem["weights"] + mem["gradients"] + mem["optimizer"]
    assert states > 780e9 and states == pytest.approx(780e9, rel=0.10)


def test_lora_on_gpt3_175b_query_and_value_at_rank_4(capsys):
    # LoRA §4.2, Practical Benefits: "On GPT-3 175B, we reduce the VRAM consumption during training from 1.2TB
    # to 350GB. With r = 4 and only the query and value projection matrices being adapted, the checkpoint size
    # is reduced by roughly 10,000x (from 350GB to 35MB)". The checkpoint is the adapters in fp16; the 350 GB
    # the frozen fp16 weights with the adapters' states (activations depend on a batch the paper leaves out).
    # Within 10% each.
    out = plan(capsys, "train", "--model", "gpt3-175b", "--seq-len", "2048", "--tokens", "1e7", "--dtype", "fp16",
               "--lora-rank", "4", "--lora-targets", "q,v")
    assert out["trainable_params"] * 2 == pytest.approx(35e6, rel=0.10)
    mem = out["memory_per_gpu"]
    assert mem["weights"] + mem["gradients"] + mem["optimizer"] == pytest.approx(350e9, rel=0.10)
