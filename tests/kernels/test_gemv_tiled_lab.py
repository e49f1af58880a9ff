"""The lab kernel of benchmarks/gpu/gemv_tiled.py (gemv_kernel's arithmetic on a layout with each
program's step contiguous, for a GPU run to time against the engine's) stays correct under the
interpreter: against a float64 matmul of the dequantized weights, and bit for bit against the
engine's gemv_kernel at the same tile and K split (so a timing difference is the layout's alone)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the script itself (it times too)")
def test_tiled_layout_kernel_matches_float64_and_the_engine_kernel(triton_ops):
    import gemv_tiled

    tiles = [(32, 16, 4, 2), (64, 8, 4, 2)]
    rows = (gemv_tiled.check([(128, 1024), (256, 512)], "cpu", torch.float32, tiles, num_sms=1)
            + gemv_tiled.check([(128, 1024)], "cpu", torch.float32, tiles, num_sms=8))
    assert len(rows) == 6 and max(r["rel_err"] for r in rows) < 2e-5
    assert all(r["equals_gemv"] for r in rows) and {r["splits"] for r in rows} >= {1, 4, 8}
