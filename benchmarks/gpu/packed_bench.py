"""The repacked 4/8-bit matmul (kernels/triton_quant_packed.py) against the GGUF-block kernel
(kernels/triton_quant.py) and cuBLAS bf16, on a 1B model's layer shapes (a GPU probe).

    python benchmarks/gpu/packed_bench.py [--rows 1,16] [--sweep [--best-json F]] [--output-json F]

Timing: each case is a CUDA graph of C launches over C distinct weight copies (C such that the
copies exceed 256 MB, four times an H200's L2), replayed; time a launch = graph time / C. So every
launch reads its weight from HBM, back to back as a decode step's layers do, and the host's launch
cost (which do_bench's Python loop adds to a 10 us kernel) is out. GB/s = the weight's bytes
(codes + scales) / time.
"""

from __future__ import annotations

import argparse
import json

import torch

SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # Llama-3.2-1B: qkv, o, gate_up, down
MIN_BYTES = 256 << 20


def graph_time_us(fns, replays: int = 20) -> float:
    """Median time of one of fns, all launched back to back in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns[:3]:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(fns))
    return sorted(times)[len(times) // 2]


def copies(nbytes: int) -> int:
    return max(4, min(400, -(-MIN_BYTES // nbytes)))


def sweep(tqp, shapes_packed, num_sms: int) -> tuple[dict, list]:
    """Every CUDA-core tile (columns, word rows a step, warps) x K-split target at one row, timed on
    each shape; the tile with the least total time over the shapes (a layer's four matmuls), against the
    tensor-core kernel's 16-row tile."""
    totals = []
    for bn in (32, 64):
        for words in (32, 64):
            for warps in (4, 8):
                for per_sm in (1, 2, 4, 8):
                    tqp.PROGRAMS_PER_SM = per_sm
                    cfg = ("gemv", 1, bn, words, warps, 2)
                    try:
                        each = [graph_time_us([lambda q=q, x=x: tqp.packed_linear(x, q, config=cfg) for q in qs],
                                              replays=10) for x, qs in shapes_packed]
                    except Exception as e:  # noqa: BLE001 (a tile that does not compile: skipped, said)
                        print(f"  gemv {bn}x{words}w w{warps}: {type(e).__name__}", flush=True)
                        break
                    totals.append((sum(each), dict(GEMV_TILE=[bn, words, warps, 2], PROGRAMS_PER_SM=per_sm), each))
    tqp.PROGRAMS_PER_SM = 4
    dot = sum(graph_time_us([lambda q=q, x=x: tqp.packed_linear(x, q, config=("dot", 16, 64, 16, 4, 3)) for q in qs],
                            replays=10) for x, qs in shapes_packed)
    totals.sort(key=lambda t: t[0])
    print(f"sweep Q4_1 one row, a layer's 4 matmuls (us): dot {dot:.1f}; gemv best:", flush=True)
    for t, c, each in totals[:10]:
        print(f"  {t:6.1f} {c['GEMV_TILE'][:3]} per SM {c['PROGRAMS_PER_SM']}: " + " ".join(f"{e:.1f}" for e in each),
              flush=True)
    best = dict(totals[0][1], GEMV_MAX_ROWS=1) if totals and totals[0][0] < dot else dict(GEMV_MAX_ROWS=0)
    return best, [(t, c, each) for t, c, each in totals]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,16")
    p.add_argument("--formats", default="Q4_1,Q8_0")
    p.add_argument("--sweep", action="store_true", help="first sweep the CUDA-core kernel's tiles at one row")
    p.add_argument("--best-json", help="write the sweep's choice here (host_profile.py --packed-tiles reads it)")
    p.add_argument("--output-json")
    args = p.parse_args()
    from engine.quant import FORMATS as BLOCK_FORMATS
    from engine.quant.quantize import quantize_int4, quantize_int8
    from kernels import triton_quant, triton_quant_packed as tqp

    dev = "cuda"
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    weights = {(n, k): torch.randn(n, k, device=dev) / k ** 0.5 for n, k in SHAPES}
    blocks_of = {}
    for (n, k), w in weights.items():
        for fmt in args.formats.split(","):
            q = quantize_int4(w.cpu(), 32) if fmt == "Q4_1" else quantize_int8(w.cpu())
            blocks_of[fmt, n, k] = q.blocks.to(dev)
    if args.sweep:
        shapes_packed = []
        for n, k in SHAPES:
            packed = tqp.pack(blocks_of["Q4_1", n, k], "Q4_1")
            shapes_packed.append((torch.randn(1, k, device=dev, dtype=torch.bfloat16),
                                  [tqp.PackedWeight(packed.words.clone(), packed.scales.clone(), "Q4_1")
                                   for _ in range(copies(packed.nbytes))]))
        best, totals = sweep(tqp, shapes_packed, num_sms)
        del shapes_packed
        print(f"chosen: {best}", flush=True)
        results.append(dict(sweep=totals, chosen=best))
        for name, value in best.items():
            setattr(tqp, name, tuple(value) if isinstance(value, list) else value)
        if args.best_json:
            with open(args.best_json, "w") as f:
                json.dump(best, f)
    for (n, k), w in weights.items():
        wb = w.to(torch.bfloat16)
        bf16s = [wb.clone() for _ in range(copies(wb.nbytes))]
        for fmt in args.formats.split(","):
            blocks = blocks_of[fmt, n, k]
            packed = tqp.pack(blocks, fmt)
            c = copies(packed.nbytes)
            blocks_c = [blocks.clone() for _ in range(c)]
            packed_c = [tqp.PackedWeight(packed.words.clone(), packed.scales.clone(), fmt) for _ in range(c)]
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                want = torch.nn.functional.linear(x.float(), BLOCK_FORMATS[fmt].dequantize(blocks))
                got = tqp.packed_linear(x, packed)
                err = ((got.float() - want).abs().max() / want.abs().max()).item()
                t_bf16 = graph_time_us([lambda wt=wt: torch.nn.functional.linear(x, wt) for wt in bf16s])
                t_old = graph_time_us([lambda b=b: triton_quant.quant_linear(x, b, fmt) for b in blocks_c])
                t_new = graph_time_us([lambda q=q: tqp.packed_linear(x, q) for q in packed_c])
                plan = tqp.launch_plan(m, n, k, fmt, num_sms)
                row = dict(n=n, k=k, rows=m, format=fmt, bf16_us=t_bf16, blocks_us=t_old, packed_us=t_new,
                           packed_gbps=packed.nbytes / t_new / 1e3, bf16_gbps=wb.nbytes / t_bf16 / 1e3,
                           blocks_gbps=blocks.nbytes / t_old / 1e3, rel_err=err, plan=str(plan))
                results.append(row)
                print(f"{fmt} {m}x{k} @ {n}x{k}: bf16 {t_bf16:6.1f} us {row['bf16_gbps']:5.0f} GB/s | blocks "
                      f"{t_old:6.1f} us {row['blocks_gbps']:5.0f} GB/s | packed {t_new:6.1f} us "
                      f"{row['packed_gbps']:5.0f} GB/s ({t_bf16 / t_new:.2f}x bf16, {t_old / t_new:.2f}x blocks) "
                      f"err {err:.1e} [{plan.kernel} {plan.block_n}x{plan.words}w s{plan.num_splits}]", flush=True)
        del bf16s
        torch.cuda.empty_cache()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
