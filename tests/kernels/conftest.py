"""Kernel tests: on a machine without a GPU the Triton kernels run on CPU under Triton's interpreter.

triton.jit decides between an interpreted and a compiled kernel when kernels/triton_*.py are first
imported, reading TRITON_INTERPRET at that moment. This conftest is imported while pytest collects
this folder, before any test module here imports the kernels, so setting the variable now is in
time (torch may already be imported; triton itself may be too: only our kernels' import matters).
With a GPU the variable is left alone and the kernels are compiled. Under the interpreter,
interpreter_bf16 makes the interpreter compute bfloat16 as a GPU does, so bf16 is checked everywhere.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from tests.kernels import interpreter_bf16

# The GGUF block tests take their oracle from the gguf package (llama.cpp's own decoder), a test
# extra that a bare GPU image (gpu_check needs torch, triton and transformers alone) may lack:
# there these two modules are left out, loudly, instead of stopping the whole collection.
try:
    import gguf  # noqa: F401
except ImportError:
    collect_ignore = ["test_quant_kernels.py", "test_triton_quant.py"]
    warnings.warn("gguf is not installed: tests/kernels/test_quant_kernels.py and test_triton_quant.py "
                  "are not collected (pip install gguf)")

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        interpreter_bf16.install()
    except ImportError:  # no triton: the triton_ops fixture skips its tests
        pass


@pytest.fixture(scope="session")
def triton_ops():
    """kernels.triton_ops, usable on this machine's test device, or a loud skip saying why not."""
    pytest.importorskip("triton")
    from kernels import triton_ops

    if not torch.cuda.is_available() and not triton_ops.INTERPRETED:
        reason = ("TRITON KERNELS NOT TESTED: kernels.triton_ops was imported before tests/kernels/conftest.py "
                  "set TRITON_INTERPRET=1, so its kernels were compiled for CUDA and cannot take CPU tensors. "
                  "Run `TRITON_INTERPRET=1 pytest ...` or run tests/kernels on their own.")
        warnings.warn(reason)
        pytest.skip(reason)
    return triton_ops
