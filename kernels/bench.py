"""Benchmark the Triton paged-attention kernel on a GPU.

  python -m kernels.bench [--output-json out.json] [--plot out.png]
  python -m kernels.bench --smoke      # tiny shapes; without CUDA, under Triton's interpreter

Decode (one query per sequence, batch 1/16/64/256 x context 512/2048/8192): achieved bandwidth
= bytes of K and V read / median kernel time, as a fraction of this device's copy bandwidth,
measured in the same run with a large device-to-device copy (bytes read + written / time).
Target: >= 70% at batch >= 16 and context >= 2048.

Prefill (whole prompts, causal): TFLOP/s of the paged kernel against
torch.nn.functional.scaled_dot_product_attention on the same shapes (ratio). SDPA gets K/V
already expanded to every query head and laid out contiguously, i.e. its best case: no paging
and no GQA indirection. Target: >= 80% of SDPA's throughput.

Times are medians of triton.testing.do_bench_cudagraph (each call captured in a CUDA graph and
replayed: the kernels' own time, no host launch; the L2 is not flushed, so the shapes whose K and V
fit in it, batch 1 x 512, read partly from it), or of do_bench with --no-cuda-graphs (L2 flushed,
timed from the host's launch); under --smoke on CPU, medians of wall-clock runs (they check the
script, not the kernel's speed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

DECODE_BATCHES, DECODE_CONTEXTS = (1, 16, 64, 256), (512, 2048, 8192)
PREFILL_SHAPES = ((1, 512), (1, 2048), (1, 8192), (8, 2048))  # (batch, prompt length)
SMOKE_DECODE_BATCHES, SMOKE_DECODE_CONTEXTS = (1, 3), (40, 100)
SMOKE_PREFILL_SHAPES = ((1, 48), (2, 40))
DECODE_TARGET, PREFILL_TARGET = 0.70, 0.80
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m kernels.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes: a syntax and logic check, no real timing")
    p.add_argument("--num-heads", type=int, default=None, help="default 32 (Llama-3-8B); 4 with --smoke")
    p.add_argument("--num-kv-heads", type=int, default=None, help="default 8; 2 with --smoke")
    p.add_argument("--head-dim", type=int, default=None, help="default 128; 64 with --smoke")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: bfloat16 on CUDA, float16 under the interpreter (it mishandles bfloat16)")
    p.add_argument("--num-splits", type=int, default=None, help="force the split-KV count (default: heuristic)")
    p.add_argument("--copy-gib", type=float, default=2.0, help="size of the copy that measures bandwidth")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="time each call from its host launch (do_bench) instead of graph replays")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="write a PNG of both tables (needs matplotlib)")
    args = p.parse_args(argv)
    for name, full, smoke in (("num_heads", 32, 4), ("num_kv_heads", 8, 2), ("head_dim", 128, 64)):
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    if args.num_heads % args.num_kv_heads:
        p.error("--num-heads must be a multiple of --num-kv-heads")
    return args


def make_timer(device: torch.device, cuda_graphs: bool = True):
    """fn -> median milliseconds per call. On CUDA, with cuda_graphs, fn is captured in a CUDA graph
    and replayed (triton.testing.do_bench_cudagraph): the time is the kernels' alone. A plain
    do_bench times from the host's launch, which for a ~30 us kernel behind a Python wrapper is
    mostly the launch, so it would understate a fast kernel several times over."""
    if device.type == "cuda":
        import triton.testing

        if cuda_graphs:
            return lambda fn: triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def wall_clock(fn, runs: int = 3) -> float:
        times = []  # the median drops the first run, which pays for the interpreter's rewrite
        for _ in range(runs):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return wall_clock


def copy_bandwidth(device: torch.device, timer, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy, counting the bytes read and the bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


def paged_batch(batch: int, q_len: int, context: int, args, dtype, device, gen):
    """Random queries and a full paged cache; each sequence's blocks scattered over the cache."""
    blocks_per_seq = -(-context // args.block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    v_cache = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    perm = torch.randperm(num_blocks, device="cpu", generator=torch.Generator().manual_seed(0))
    return dict(
        query=torch.randn(batch * q_len, args.num_heads, args.head_dim, dtype=dtype, device=device, generator=gen),
        k_cache=k_cache, v_cache=v_cache,
        block_tables=perm.view(batch, blocks_per_seq).to(device=device, dtype=torch.int32),
        query_start_loc=torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        scale=1.0 / math.sqrt(args.head_dim))


def call(triton_ops, t, num_splits):
    return triton_ops.paged_attention(t["query"], t["k_cache"], t["v_cache"], t["block_tables"],
                                      t["query_start_loc"], t["seq_lens"], t["scale"], num_splits=num_splits)


def check(triton_ops, t, num_splits) -> None:
    """The timed kernel must also be right: compare once with the reference on this device."""
    from kernels import reference

    got = call(triton_ops, t, num_splits).float()
    want = reference.paged_attention(t["query"], t["k_cache"], t["v_cache"], t["block_tables"],
                                     t["query_start_loc"], t["seq_lens"], t["scale"]).float()
    err = (got - want).abs().max().item()
    assert err < 5e-2, f"Triton paged attention disagrees with the reference by {err}"


def bench_decode(triton_ops, timer, copy_bw, args, dtype, device, gen, batches, contexts):
    rows = []
    for context in contexts:
        for batch in batches:
            t = paged_batch(batch, 1, context, args, dtype, device, gen)
            if not rows:
                check(triton_ops, t, args.num_splits)
            cfg, splits = triton_ops.launch_plan(t["query"], t["k_cache"], t["block_tables"], batch,
                                                 num_splits=args.num_splits)
            # t is bound as a default argument, not closed over: the same thing here, as the lambda runs only
            # inside timer(), but pyflakes (F821) flags a closure over a name that is `del`-ed later.
            ms = timer(lambda t=t: call(triton_ops, t, args.num_splits))
            kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * t["k_cache"].element_size()
            frac = kv_bytes / (ms * 1e-3) / copy_bw
            target = DECODE_TARGET if batch >= 16 and context >= 2048 else None
            rows.append(dict(phase="decode", batch=batch, context=context, splits=splits, block_m=cfg.block_m,
                             ms=ms, gb_per_s=kv_bytes / (ms * 1e-3) / 1e9, fraction=frac, target=target,
                             meets=None if target is None else frac >= target))
            del t
    return rows


def bench_prefill(triton_ops, timer, args, dtype, device, gen, shapes):
    import torch.nn.functional as F

    rows = []
    group = args.num_heads // args.num_kv_heads
    for batch, length in shapes:
        t = paged_batch(batch, length, length, args, dtype, device, gen)
        if not rows:
            check(triton_ops, t, args.num_splits)
        cfg, splits = triton_ops.launch_plan(t["query"], t["k_cache"], t["block_tables"], batch,
                                             num_splits=args.num_splits)
        ms = timer(lambda t=t: call(triton_ops, t, args.num_splits))
        q = torch.randn(batch, args.num_heads, length, args.head_dim, dtype=dtype, device=device, generator=gen)
        k = torch.randn(batch, args.num_kv_heads, length, args.head_dim, dtype=dtype, device=device, generator=gen)
        k = k.repeat_interleave(group, dim=1).contiguous()
        v = torch.randn_like(k)
        # Bound as default arguments, not closed over, because of the `del` below (see bench_decode).
        sdpa_ms = timer(lambda q=q, k=k, v=v, t=t:
                        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=t["scale"]))
        # Causal: each of the two matmuls (QK^T, PV) does L(L+1)/2 * d multiply-adds per head.
        flops = 4 * batch * args.num_heads * args.head_dim * length * (length + 1) / 2
        ratio = sdpa_ms / ms
        rows.append(dict(phase="prefill", batch=batch, context=length, splits=splits, block_m=cfg.block_m,
                         ms=ms, tflops=flops / (ms * 1e-3) / 1e12, sdpa_ms=sdpa_ms,
                         sdpa_tflops=flops / (sdpa_ms * 1e-3) / 1e12, fraction=ratio, target=PREFILL_TARGET,
                         meets=ratio >= PREFILL_TARGET))
        del t, q, k, v
    return rows


def print_table(rows, copy_bw) -> None:
    print(f"device copy bandwidth: {copy_bw / 1e9:.1f} GB/s (read + write)")
    print(f"{'phase':8} {'batch':>5} {'context':>7} {'splits':>6} {'ms':>9} {'achieved':>14} "
          f"{'vs':>14} {'fraction':>8}  target")
    for r in rows:
        if r["phase"] == "decode":
            achieved, versus = f"{r['gb_per_s']:.1f} GB/s", "copy"
        else:
            achieved, versus = f"{r['tflops']:.2f} TFLOP/s", f"{r['sdpa_tflops']:.2f} SDPA"
        target = "-" if r["target"] is None else f">= {r['target']:.0%} {'ok' if r['meets'] else 'MISSED'}"
        print(f"{r['phase']:8} {r['batch']:>5} {r['context']:>7} {r['splits']:>6} {r['ms']:>9.4f} "
              f"{achieved:>14} {versus:>14} {r['fraction']:>8.1%}  {target}")


def plot(rows, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed (pip install matplotlib); no plot written", file=sys.stderr)
        return
    fig, (ax_d, ax_p) = plt.subplots(1, 2, figsize=(11, 4))
    decode = [r for r in rows if r["phase"] == "decode"]
    for context in sorted({r["context"] for r in decode}):
        pts = [r for r in decode if r["context"] == context]
        ax_d.plot([r["batch"] for r in pts], [r["fraction"] for r in pts], marker="o", label=f"context {context}")
    ax_d.axhline(DECODE_TARGET, color="gray", linestyle="--", label="target")
    ax_d.set_xscale("log", base=2)
    ax_d.set(xlabel="batch", ylabel="fraction of copy bandwidth", title="decode")
    ax_d.legend()
    prefill = [r for r in rows if r["phase"] == "prefill"]
    labels = [f"{r['batch']}x{r['context']}" for r in prefill]
    ax_p.bar(labels, [r["fraction"] for r in prefill])
    ax_p.axhline(PREFILL_TARGET, color="gray", linestyle="--")
    ax_p.set(xlabel="batch x prompt", ylabel="throughput / SDPA", title="prefill")
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        if not args.smoke:
            print("no CUDA device: the benchmark measures GPU kernels; use --smoke for a check on CPU", file=sys.stderr)
            return 2
        # triton.jit reads this when kernels.triton_ops is first imported, just below.
        os.environ["TRITON_INTERPRET"] = "1"
    from kernels import triton_ops

    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float16")]
    gen = torch.Generator(device=device).manual_seed(0)
    timer = make_timer(device, cuda_graphs=not args.no_cuda_graphs)
    copy_bw = copy_bandwidth(device, timer, int(args.copy_gib * 2**30) if not args.smoke else 2**24)
    batches, contexts = ((SMOKE_DECODE_BATCHES, SMOKE_DECODE_CONTEXTS) if args.smoke
                         else (DECODE_BATCHES, DECODE_CONTEXTS))
    rows = bench_decode(triton_ops, timer, copy_bw, args, dtype, device, gen, batches, contexts)
    rows += bench_prefill(triton_ops, timer, args, dtype, device, gen,
                          SMOKE_PREFILL_SHAPES if args.smoke else PREFILL_SHAPES)
    print_table(rows, copy_bw)
    if args.output_json:
        meta = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
                    dtype=str(dtype).removeprefix("torch."), copy_gb_per_s=copy_bw / 1e9, smoke=args.smoke,
                    **{k: getattr(args, k) for k in ("num_heads", "num_kv_heads", "head_dim", "block_size")})
        with open(args.output_json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=2)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
