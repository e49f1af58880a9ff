"""A lab kernel, not the engine's: the one-row int4 matmul of kernels/triton_quant_packed.py
(gemv_kernel's arithmetic, unchanged) on a layout where each program's step is one contiguous run
of memory, and the engine's kernel at tiles its sweeps never tried (1-2 warps; 128-256 columns).

Why try it: gemv_kernel reads a 16384 x 2048 Q4_1 weight at 1.6 TB/s on an H200 where cuBLAS reads
bf16 at 3.5 TB/s (BENCHMARKS.md, "GPU"), and no tile of 32-64 columns x 4-8 warps moved it.
In the engine's layout (words [K / 8, N]) a program's step of 32 columns x 64 word rows is 64 runs
of 128 bytes, 64 KB apart, plus 16 x 2 runs of 64 bytes of scales; a bf16 GEMV reads runs of KBs.
If DRAM pages opened for 128 bytes, or too few bytes in flight a program, are the bound, a layout
with each step's words (8 KB) and scales (2 KB) contiguous, or more and smaller programs, should
read faster; if issue is the bound (~30 instructions a word of codes), neither will.

    tiled  words  int32 [N / BN, K / (8 W), W, BN]   step s of column tile t: W word rows x BN columns
           scales fp16  [N / BN, K / 32, 2, BN]       a block's d then m, for the tile's BN columns

    python benchmarks/gpu/gemv_tiled.py [--output-json F]       # on a GPU: check, then time
    TRITON_INTERPRET=1 python benchmarks/gpu/gemv_tiled.py      # on a CPU: the check alone

The check: against the float64 product of the dequantized weights (engine.quant), within float32
accumulation; and bit for bit against gemv_kernel at the same tile and split on the interpreter
(the same sums in the same order), so that the comparison is one of memory layout alone.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from kernels import triton_quant_packed as tqp


def tile(w: tqp.PackedWeight, block_n: int, words: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's Q4_1 layout -> the tiled one (module docstring) for BLOCK_N x WORDS steps."""
    n, k = w.shape
    assert w.format == "Q4_1" and n % block_n == 0 and (k // 8) % words == 0
    tw = w.words.reshape(k // 8 // words, words, n // block_n, block_n).permute(2, 0, 1, 3).contiguous()
    ts = w.scales.reshape(2, k // 32, n // block_n, block_n).permute(2, 1, 0, 3).contiguous()
    return tw, ts


@triton.jit(do_not_specialize=["stride_split"])
def gemv_tiled_kernel(x_ptr, words_ptr, scales_ptr, out_ptr, part_ptr, count_ptr, N, K, k_per_split, stride_split,
                      BLOCK_N: tl.constexpr, WORDS: tl.constexpr, PARTIAL: tl.constexpr):
    """gemv_kernel (EVEN, Q4_1, loading a step ahead) on the tiled layout: per word
    s = sum_j x[k] u_j, acc += d s + m sum_j x[k]; the last split of a column tile to arrive sums
    the partials."""
    P: tl.constexpr = 8
    HALF: tl.constexpr = 4
    WPG: tl.constexpr = 4  # words a 32-weight block spans
    STEP: tl.constexpr = WORDS * P
    t = tl.program_id(0)
    num_steps = K // STEP
    num_groups = K // 32
    c = tl.arange(0, BLOCK_N)
    r = tl.arange(0, WORDS)
    tile_words = words_ptr + t.to(tl.int64) * num_steps * WORDS * BLOCK_N + r[:, None] * BLOCK_N + c[None, :]
    tile_scales = scales_ptr + t.to(tl.int64) * num_groups * 2 * BLOCK_N + c[None, :]
    first = tl.program_id(1) * k_per_split
    last = first + k_per_split
    s0 = first // STEP
    words = tl.load(tile_words + s0 * WORDS * BLOCK_N)
    g = (s0 * WORDS + r) // WPG
    d = tl.load(tile_scales + (g * 2)[:, None] * BLOCK_N).to(tl.float32)
    mn = tl.load(tile_scales + (g * 2 + 1)[:, None] * BLOCK_N).to(tl.float32)
    acc = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
    wr = first // P + r
    for k0 in range(first, last, STEP):
        ahead = tl.minimum(k0 + STEP, last - STEP) // STEP  # the last step: itself again (cache hits)
        next_words = tl.load(tile_words + ahead * WORDS * BLOCK_N)
        ng = (ahead * WORDS + r) // WPG
        next_d = tl.load(tile_scales + (ng * 2)[:, None] * BLOCK_N).to(tl.float32)
        next_mn = tl.load(tile_scales + (ng * 2 + 1)[:, None] * BLOCK_N).to(tl.float32)
        high = words >> 16
        x_ptrs = x_ptr + wr * P
        s = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
        xs = tl.zeros((WORDS,), dtype=tl.float32)
        for j in tl.static_range(HALF):
            p, x = tqp._code_products(x_ptrs, None, words, j, 4, False)
            s += p
            xs += x
            p, x = tqp._code_products(x_ptrs + HALF, None, high, j, 4, False)
            s += p
            xs += x
        acc += d * s + mn * xs[:, None]
        wr += WORDS
        words, d, mn = next_words, next_d, next_mn
    cols = t * BLOCK_N + c
    tqp.finish_row(tl.sum(acc, axis=0), out_ptr, part_ptr, count_ptr, out_ptr, cols, cols < N, stride_split, PARTIAL,
                   False)


def splits_for(n: int, k: int, block_n: int, words: int, programs_per_sm: int, num_sms: int) -> int:
    """gemv_kernel's rule (triton_quant_packed.launch_plan), kept to whole steps a split."""
    tiles, steps = n // block_n, k // (words * 8)
    splits = 1
    while splits < tqp.MAX_SPLIT_K and steps % (splits * 2) == 0 and tiles * splits * 2 <= programs_per_sm * num_sms:
        splits *= 2
    return splits


def gemv_tiled(x: torch.Tensor, tiled: tuple[torch.Tensor, torch.Tensor], n: int, k: int, block_n: int, words: int,
               num_warps: int, splits: int) -> torch.Tensor:
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    part = torch.empty(splits, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    counts = tqp.split_counts(x.device, n // block_n) if splits > 1 else out
    gemv_tiled_kernel[(n // block_n, splits)](x, tiled[0], tiled[1], out, part, counts, n, k, k // splits, n,
                                              BLOCK_N=block_n, WORDS=words, PARTIAL=splits > 1, num_warps=num_warps)
    return out


def _weights(n: int, k: int, dev: str):
    from engine.quant.quantize import quantize_int4

    gen = torch.Generator().manual_seed(n + k)
    blocks = quantize_int4(torch.randn(n, k, generator=gen) / k ** 0.5, 32).blocks
    return blocks, tqp.pack(blocks.to(dev), "Q4_1"), torch.randn(1, k, generator=gen)


def check(shapes, dev: str, dtype: torch.dtype, tiles, num_sms: int) -> list[dict]:
    """Each tile (block_n, words, warps, programs a SM) on each shape it divides: against float64,
    and against gemv_kernel at the same tile and split, bit for bit."""
    from engine.quant import FORMATS

    rows = []
    for n, k in shapes:
        blocks, packed, x = _weights(n, k, dev)
        want = x.to(dtype).double() @ FORMATS["Q4_1"].dequantize(blocks).double().t()
        x = x.to(dtype).to(dev)
        for block_n, words, warps, per_sm in tiles:
            if n % block_n or (k // 8) % words:
                continue
            splits = splits_for(n, k, block_n, words, per_sm, num_sms)
            got = gemv_tiled(x, tile(packed, block_n, words), n, k, block_n, words, warps, splits)
            engine = tqp.packed_linear(x, packed, num_splits=splits, config=("gemv", 1, block_n, words, warps, 2))
            err = (got.double().cpu() - want).abs().max().item() / want.abs().max().item()
            same = torch.equal(got, engine)
            rows.append(dict(n=n, k=k, tile=[block_n, words, warps], splits=splits, rel_err=err, equals_gemv=same))
            print(f"check {n}x{k} {block_n}x{words}w w{warps} splits {splits}: {err:.1e} from float64; "
                  f"equal to gemv_kernel: {same}", flush=True)
            assert err < (4e-3 if dtype == torch.bfloat16 else 2e-5), f"{n}x{k}: {err}"
            # the same sums in the same order: equal on the interpreter; on a GPU the compiler may lay
            # the two loads' registers out differently, and with them the final reduction's order
            assert same or dev != "cpu", f"{n}x{k}: the tiled layout changed the sums"
    return rows


# (block_n, word rows a step, warps, programs a SM): the tiled kernel's sweep
TILED = [(bn, w, warps, per_sm) for bn in (32, 64, 128) for w in (32, 64) for warps in (2, 4) for per_sm in (2, 4)]
# the engine's kernel at tiles packed_bench.py's sweep did not try (32-64 columns x 32-64 word rows x 4-8 warps)
ENGINE_MORE = [(32, 64, 1, 4), (32, 64, 2, 4), (32, 32, 1, 8), (64, 32, 2, 4), (128, 16, 4, 2), (128, 32, 4, 2),
               (256, 8, 4, 2), (256, 16, 8, 2)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        tiles = [(32, 16, 4, 2), (64, 8, 4, 2), (32, 16, 2, 8)]
        check([(128, 1024), (256, 512)], "cpu", torch.float32, tiles, num_sms=1)
        check([(128, 1024)], "cpu", torch.float32, tiles, num_sms=8)  # K split 2-8 ways
        return
    import packed_bench  # benchmarks/gpu, beside this script

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = dict(check=check(packed_bench.SHAPES[:2], "cuda", torch.bfloat16, TILED[::5], num_sms), time=[])
    for n, k in packed_bench.SHAPES:
        _, packed, x = _weights(n, k, "cuda")
        x = x.to(torch.bfloat16).cuda()
        copies = [tqp.PackedWeight(packed.words.clone(), packed.scales.clone(), "Q4_1")
                  for _ in range(packed_bench.copies(packed.nbytes))]
        base = packed_bench.graph_time_us([lambda q=q: tqp.packed_linear(x, q) for q in copies])
        row = dict(n=n, k=k, gemv_us=base, tiled=[], engine_more=[])
        for block_n, words, warps, per_sm in ENGINE_MORE:
            if n % block_n or (k // 8) % words:
                continue
            tqp.PROGRAMS_PER_SM = per_sm
            cfg = ("gemv", 1, block_n, words, warps, 2)
            try:
                t = packed_bench.graph_time_us([lambda q=q: tqp.packed_linear(x, q, config=cfg) for q in copies])
            except Exception as e:  # noqa: BLE001 (a tile that does not compile: said, skipped)
                print(f"  engine {n}x{k} {cfg}: {type(e).__name__}: {e}"[:200], flush=True)
                continue
            row["engine_more"].append(dict(tile=[block_n, words, warps], per_sm=per_sm, us=t))
        tqp.PROGRAMS_PER_SM = 2
        for block_n, words, warps, per_sm in TILED:
            if n % block_n or (k // 8) % words:
                continue
            tiled = [tile(q, block_n, words) for q in copies]
            splits = splits_for(n, k, block_n, words, per_sm, num_sms)
            try:
                t = packed_bench.graph_time_us([lambda tq=tq: gemv_tiled(x, tq, n, k, block_n, words, warps, splits)
                                                for tq in tiled])
            except Exception as e:  # noqa: BLE001
                print(f"  tiled {n}x{k} {block_n}x{words}w w{warps}: {type(e).__name__}: {e}"[:200], flush=True)
                continue
            finally:
                del tiled
            row["tiled"].append(dict(tile=[block_n, words, warps], per_sm=per_sm, splits=splits, us=t))
        for key in ("tiled", "engine_more"):
            row[key].sort(key=lambda v: v["us"])
        results["time"].append(row)
        gbs = packed.nbytes / 1e3
        best = {key: row[key][0] if row[key] else None for key in ("tiled", "engine_more")}
        said = [f"{key} best {b['us']:.1f} us ({gbs / b['us']:.0f} GB/s) {b}" for key, b in best.items() if b]
        print(f"{n}x{k}: gemv_kernel {base:.1f} us ({gbs / base:.0f} GB/s); " + "; ".join(said), flush=True)
        del copies
        torch.cuda.empty_cache()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
