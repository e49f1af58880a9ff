"""The lab kernel of benchmarks/gpu/gemv_dp4a.py (the one-row Q4_1 matmul on int8 activations and
dp4a, for a GPU run to time against the engine's) stays correct under the interpreter, dp4a
emulated: against a float64 matmul of the dequantized weights and the activations as it rounds
them, unsplit and with K split (the last split to arrive sums)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the script itself (it times too)")
def test_lab_kernel_matches_its_oracle(triton_ops):
    import gemv_dp4a

    rows = gemv_dp4a.check([(128, 1024)], "cpu", torch.float32) + gemv_dp4a.check([(128, 1024)], "cpu",
                                                                                   torch.float32, num_sms=8)
    assert len(rows) == 4 and max(r["rel_err"] for r in rows) < 2e-5
    assert min(r["activation_rounding_rel"] for r in rows) > 1e-4  # the int8 rounding is real, and measured apart
