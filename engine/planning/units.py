"""Byte sizes of the number formats the estimators count in, and the GiB unit the tables print."""

from __future__ import annotations

GiB = 1 << 30
MiB = 1 << 20

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "int8": 1, "fp8": 1}


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype named as torch, Hugging Face configs or the CLI spell it."""
    key = str(name).removeprefix("torch.").lower()
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]
