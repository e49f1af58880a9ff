"""`python -m kernels.cpu_bench` runs end to end and writes consistent results (its numbers are
benchmarks, recorded in BENCHMARKS.md, not asserted here)."""

from __future__ import annotations

import json

import pytest

from kernels import cpu_build

# slow: every op at every size, ~30 s on 2 cores (the fast lane has the kernels' own tests).
pytestmark = [pytest.mark.skipif(cpu_build.available() is not None, reason="the CPU kernels did not build"),
              pytest.mark.slow]


def test_cpu_bench_writes_every_op(tmp_path):
    from kernels import cpu_bench

    out = tmp_path / "bench.json"
    assert cpu_bench.main(["--runs", "1", "--dtype", "float32", "--output-json", str(out),
                           "--plot", str(tmp_path / "bench.png")]) == 0
    result = json.loads(out.read_text())
    ops = [r["op"] for r in result["rows"]]
    assert len(ops) == len(set(ops)) == 20  # 4 attention cases, 6 per-token ops, 3 matmuls, 7 MoE sizes
    for r in result["rows"]:
        assert r["torch_ms"] > 0 and r["cpu_ms"] > 0
        assert r["speedup"] == pytest.approx(r["torch_ms"] / r["cpu_ms"])
    assert (tmp_path / "bench.png").stat().st_size > 0
