"""`python -m kernels.bench --smoke` runs end to end (tiny shapes; real numbers need a GPU)."""

from __future__ import annotations

import json

import torch

from kernels import bench


def test_bench_smoke_writes_table_json_and_plot(triton_ops, tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert bench.main(["--smoke", "--output-json", str(out_json), "--plot", str(out_png)]) == 0
    report = json.loads(out_json.read_text())
    decode = [r for r in report["rows"] if r["phase"] == "decode"]
    prefill = [r for r in report["rows"] if r["phase"] == "prefill"]
    assert len(decode) == len(bench.SMOKE_DECODE_BATCHES) * len(bench.SMOKE_DECODE_CONTEXTS)
    assert len(prefill) == len(bench.SMOKE_PREFILL_SHAPES)
    assert all(r["ms"] > 0 and r["fraction"] > 0 for r in report["rows"])
    assert report["meta"]["copy_gb_per_s"] > 0
    if not torch.cuda.is_available():
        assert report["meta"]["dtype"] == "float16"
    assert "device copy bandwidth" in capsys.readouterr().out
    assert out_png.stat().st_size > 0
