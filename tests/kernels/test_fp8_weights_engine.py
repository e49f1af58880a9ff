"""`--quantization fp8` end to end: the triton backend (compiled on a GPU, else interpreted) equals
the torch reference's greedy tokens; the cpu backend refuses it naming the flag."""

from __future__ import annotations

import random

import pytest

from engine import LLM
from tests.engine.engine_runs import engine_greedy
from tests.kernels.kernel_cases import DEVICE
from tests.tiny_model import build_tiny_model


@pytest.mark.slow  # ~15 s under the interpreter
def test_fp8_triton_equals_torch(triton_ops, tmp_path, monkeypatch):
    from kernels import triton_quant

    path = build_tiny_model(tmp_path / "tiny", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                            num_key_value_heads=2)
    formats = []
    kernel = triton_quant.quant_linear
    monkeypatch.setattr(triton_quant, "quant_linear", lambda *a, **kw: formats.append(a[2]) or kernel(*a, **kw))
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 9, 21)]
    # DEVICE: the Triton kernels are compiled for CUDA where there is a GPU and take no CPU tensors.
    config = dict(quantization="fp8", dtype="float32", device=DEVICE, num_kv_blocks=32, max_model_len=128,
                  max_num_batched_tokens=24)
    got = engine_greedy(path, prompts, 6, attention_backend="triton", **config)
    assert set(formats) == {"F8_E4M3"}
    assert got == engine_greedy(path, prompts, 6, attention_backend="torch", **config)


def test_fp8_on_the_cpu_backend_is_a_value_error(tmp_path):
    path = build_tiny_model(tmp_path / "tiny", hidden_size=128, intermediate_size=256)
    with pytest.raises(ValueError, match=r"--quantization fp8\): the cpu backend has no fp8 matmul"):
        LLM(path, quantization="fp8", attention_backend="cpu", device="cpu", num_kv_blocks=16, max_model_len=64)
