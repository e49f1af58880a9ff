"""Multi-LoRA shrink and expand on the CPU: kernels/cpu_lora.cpp, built by kernels/cpu_build.load_lora
on the first LoRA call (an engine serving no adapters never compiles it). Called twice per linear
layer per step, so each wrapper is one call into C++, which checks the shapes and slots itself.
kernels/reference.py defines both ops."""

from __future__ import annotations

import torch

from kernels.cpu_build import load_lora


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    return load_lora().lora_shrink(x, lora_a, token_slots)


def lora_expand(y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor,
                out_slices: tuple[int, ...]) -> None:
    load_lora().lora_expand(y, buf, lora_b, token_slots, out_slices)
