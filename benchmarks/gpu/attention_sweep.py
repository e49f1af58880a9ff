"""Sweep the Triton paged-attention launch choices on a GPU: split counts and tiles for decode,
tiles for prefill (a GPU probe; kernels/triton_heuristics.py takes what it finds).

    python benchmarks/gpu/attention_sweep.py [--output-json out.json] [--budget-s 150]

Shapes and timing as kernels/bench.py (Llama-3-8B heads: 32 query, 8 KV, d=128, bf16, block 16;
triton.testing.do_bench medians). Each row: the configuration, ms, and its fraction of the copy
bandwidth (decode) or of torch SDPA's throughput (prefill); the heuristic's own choice is marked.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

DECODE_SHAPES = ((16, 2048), (16, 8192), (4, 8192), (1, 8192), (64, 2048), (32, 4096))
DECODE_SPLITS = (1, 2, 4, 8, 16, 32)
# (block_n, num_warps, num_stages); block_m is the smallest that holds the group (16)
DECODE_TILES = ((64, 4, 3), (32, 4, 3), (64, 4, 4), (128, 4, 3), (64, 8, 3), (32, 2, 4), (128, 4, 2), (128, 8, 3))
PREFILL_SHAPES = ((1, 2048), (8, 2048), (1, 8192))
PREFILL_TILES = tuple((m, n, w, s) for m in (64, 128) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4))


def main() -> int:
    import triton.testing

    from kernels import bench, triton_ops
    from kernels.triton_heuristics import TileConfig

    p = argparse.ArgumentParser()
    p.add_argument("--output-json", default=None)
    p.add_argument("--budget-s", type=float, default=150.0)
    p.add_argument("--decode-shapes", default=None, help="BxC,... (default: DECODE_SHAPES)")
    p.add_argument("--prefill-shapes", default=None, help="BxL,... ('' for none; default: PREFILL_SHAPES)")
    args = p.parse_args()

    def shapes(text, default):
        return default if text is None else tuple(tuple(int(v) for v in s.split("x")) for s in text.split(",") if s)
    shape_args = argparse.Namespace(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    start = time.perf_counter()

    def timer(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")

    copy_bw = bench.copy_bandwidth(dev, timer, 2 * 2**30)
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    for batch, context in shapes(args.decode_shapes, DECODE_SHAPES):
        t = bench.paged_batch(batch, 1, context, shape_args, dtype, dev, gen)
        auto_cfg, auto_splits = triton_ops.launch_plan(t["query"], t["k_cache"], t["block_tables"], batch)
        kv_bytes = 2 * batch * context * 8 * 128 * 2
        best = None
        for splits in DECODE_SPLITS:
            for bn, w, s in DECODE_TILES:
                if time.perf_counter() - start > args.budget_s * 0.6:
                    break
                cfg = TileConfig(auto_cfg.block_m, bn, w, s)
                try:
                    ms = timer(lambda t=t, cfg=cfg, splits=splits: triton_ops.paged_attention(
                        t["query"], t["k_cache"], t["v_cache"], t["block_tables"], t["query_start_loc"],
                        t["seq_lens"], t["scale"], num_splits=splits, config=cfg))
                except Exception as e:  # out of shared memory, say
                    print(f"decode {batch}x{context} splits {splits} {cfg}: {type(e).__name__}", flush=True)
                    continue
                frac = kv_bytes / (ms * 1e-3) / copy_bw
                auto = splits == auto_splits and cfg == auto_cfg
                rows.append(dict(phase="decode", batch=batch, context=context, splits=splits, block_n=bn,
                                 num_warps=w, num_stages=s, ms=ms, fraction=frac, heuristic=auto))
                if best is None or ms < best["ms"]:
                    best = rows[-1]
        heur = [r for r in rows if r["phase"] == "decode" and r["batch"] == batch and r["context"] == context
                and r["heuristic"]]
        print(f"decode {batch}x{context}: heuristic {heur[0]['fraction'] if heur else float('nan'):.1%} "
              f"(splits {auto_splits}); best {best['fraction']:.1%} splits {best['splits']} "
              f"bn {best['block_n']} w {best['num_warps']} s {best['num_stages']}", flush=True)
        del t
    import torch.nn.functional as F

    for batch, length in shapes(args.prefill_shapes, PREFILL_SHAPES):
        t = bench.paged_batch(batch, length, length, shape_args, dtype, dev, gen)
        q = torch.randn(batch, 32, length, 128, dtype=dtype, device=dev)
        k = torch.randn(batch, 32, length, 128, dtype=dtype, device=dev)
        v = torch.randn_like(k)
        sdpa_ms = timer(lambda q=q, k=k, v=v, s=t["scale"]:
                        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=s))
        auto_cfg, _ = triton_ops.launch_plan(t["query"], t["k_cache"], t["block_tables"], batch)
        best = None
        for m, n, w, s in PREFILL_TILES:
            if time.perf_counter() - start > args.budget_s:
                break
            cfg = TileConfig(m, n, w, s)
            try:
                ms = timer(lambda t=t, cfg=cfg: triton_ops.paged_attention(
                    t["query"], t["k_cache"], t["v_cache"], t["block_tables"], t["query_start_loc"],
                    t["seq_lens"], t["scale"], num_splits=1, config=cfg))
            except Exception as e:
                print(f"prefill {batch}x{length} {cfg}: {type(e).__name__}", flush=True)
                continue
            rows.append(dict(phase="prefill", batch=batch, context=length, block_m=m, block_n=n, num_warps=w,
                             num_stages=s, ms=ms, sdpa_ms=sdpa_ms, fraction=sdpa_ms / ms, heuristic=cfg == auto_cfg))
            if best is None or ms < best["ms"]:
                best = rows[-1]
        heur = [r for r in rows if r["phase"] == "prefill" and r["batch"] == batch and r["context"] == length
                and r["heuristic"]]
        if best:
            print(f"prefill {batch}x{length}: heuristic {heur[0]['fraction'] if heur else float('nan'):.1%}; "
                  f"best {best['fraction']:.1%} m {best['block_m']} n {best['block_n']} w {best['num_warps']} "
                  f"s {best['num_stages']}", flush=True)
        del t, q, k, v
    for r in sorted([r for r in rows if r["phase"] == "prefill"], key=lambda r: -r["fraction"])[:12]:
        print("prefill top:", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(copy_gb_per_s=copy_bw / 1e9, rows=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
