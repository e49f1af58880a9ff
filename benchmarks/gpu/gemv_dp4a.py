"""A lab kernel, not the engine's: the one-row Q4_1 matmul with int8 activations and dp4a, as
llama.cpp's CUDA backend multiplies its 4-bit blocks at batch 1 (mmvq: activations quantized to
int8 per 32-block, 4 products and their sum per integer instruction).

Why try it: the engine's one-row kernel (kernels/triton_quant_packed.py gemv_kernel) reads a
16384 x 2048 int4 weight at 1.6 TB/s on an H200 where cuBLAS reads bf16 at 3.5 TB/s, and no tile
moved it (BENCHMARKS.md, "GPU"). It spends about 30 instructions a 32-bit word of codes (a
mask, a subtract and a multiply-add per code). Here a word takes two masks and two dp4a: of the 8
codes, the even ones' bytes against the even activations' bytes, then the odd ones'. The cost is
the activations' rounding to int8 (a scale per 32 of them), which llama.cpp accepts; the engine's
cpu backend offers the same (--cpu-gguf-activations int8).

Each program quantizes the activations of its own K range (no extra launch), so wide column
tiles amortize that. K splits are summed by the last split to arrive, as in gemv_kernel.

    python benchmarks/gpu/gemv_dp4a.py [--output-json F]          # on a GPU: check, then time
    TRITON_INTERPRET=1 python benchmarks/gpu/gemv_dp4a.py         # on a CPU: the check alone

The check: the kernel against a float64 matmul of the dequantized weights and the activations as
the kernel rounds them (the same float32 steps in torch), within float32 accumulation. On the
interpreter dp4a is emulated with shifts; on a GPU it is the PTX instruction.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

from kernels import triton_quant_packed as tqp

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


@triton.jit
def _dp4a(a, b, c, EMULATE: tl.constexpr):
    """c + the sum over 4 bytes of a (unsigned) times b's (signed), int32 elementwise."""
    if EMULATE:
        for i in tl.static_range(4):
            c += ((a >> (8 * i)) & 0xFF) * ((b << (24 - 8 * i)) >> 24)
        return c
    else:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def _round_away(v):
    """Round half away from zero (C's roundf, llama.cpp's quantizers)."""
    return tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v))


@triton.jit(do_not_specialize=["stride_split"])
def gemv_q8x_kernel(x_ptr, words_ptr, scales_ptr, out_ptr, part_ptr, count_ptr, N, K, k_per_split, stride_split,
                    BLOCK_N: tl.constexpr, G: tl.constexpr, PARTIAL: tl.constexpr, EMULATE: tl.constexpr):
    """One row, Q4_1 weights in triton_quant_packed's layout (words [K / 8, N], scales [2, K / 32, N]),
    whole tiles only. A step is G blocks of 32 weights: their activations quantized to int8 with
    their own scale dx (amax / 127), packed 4 to an int32 in the codes' byte order; per word two
    dp4a; per block and column d dx sum(u q) + m dx sum(q)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first = tl.program_id(1) * k_per_split
    last = tl.minimum(first + k_per_split, K)
    num_groups = K // 32
    acc = tl.zeros((G, BLOCK_N), dtype=tl.float32)
    for k0 in range(first, last, G * 32):
        g = k0 // 32 + tl.arange(0, G)
        wr = g[:, None] * 4 + tl.arange(0, 4)[None, :]  # a block's 4 words
        words = tl.load(words_ptr + wr.to(tl.int64)[:, :, None] * N + cols[None, None, :])  # [G, 4, BLOCK_N]
        sp = scales_ptr + g.to(tl.int64)[:, None] * N + cols[None, :]
        d = tl.load(sp).to(tl.float32)
        m = tl.load(sp + num_groups * N).to(tl.float32)
        xk = tl.load(x_ptr + g[:, None] * 32 + tl.arange(0, 32)[None, :]).to(tl.float32)  # [G, 32]
        dx = tl.max(tl.abs(xk), axis=1) / 127
        q = _round_away(xk * tl.where(dx > 0, 1 / dx, 0.0)[:, None]).to(tl.int32)
        sx = dx * tl.sum(q, axis=1).to(tl.float32)
        # weight k = 8 word + j, code j at bits 4j: bytes of (w & 0x0F0F0F0F) hold the even codes,
        # of (w >> 4 & 0x0F0F0F0F) the odd ones; the activations packed to match
        q4 = tl.reshape(q, (G, 4, 4, 2))
        parity = tl.arange(0, 2)[None, None, None, :]
        shift = (tl.arange(0, 4) * 8)[None, None, :]
        xa = tl.sum((tl.sum(tl.where(parity == 0, q4, 0), axis=3) & 0xFF) << shift, axis=2)  # [G, 4]
        xb = tl.sum((tl.sum(tl.where(parity == 1, q4, 0), axis=3) & 0xFF) << shift, axis=2)
        dot = _dp4a(words & 0x0F0F0F0F, tl.broadcast_to(xa[:, :, None], (G, 4, BLOCK_N)),
                    tl.zeros((G, 4, BLOCK_N), dtype=tl.int32), EMULATE)
        dot = _dp4a((words >> 4) & 0x0F0F0F0F, tl.broadcast_to(xb[:, :, None], (G, 4, BLOCK_N)), dot, EMULATE)
        acc += d * (dx[:, None] * tl.sum(dot, axis=1).to(tl.float32)) + m * sx[:, None]
    tqp.finish_row(tl.sum(acc, axis=0), out_ptr, part_ptr, count_ptr, out_ptr, cols, cols < N, stride_split, PARTIAL,
                   False)


def gemv_q8x(x: torch.Tensor, w: tqp.PackedWeight, block_n: int = 128, g: int = 16, num_warps: int = 4,
             programs_per_sm: int = 2, num_sms: int | None = None) -> torch.Tensor:
    """x [1, K] @ dequantize(w)^T with x rounded to int8 per 32 (see the module docstring)."""
    assert w.format == "Q4_1" and x.shape[0] == 1
    n, k = w.shape
    step = g * 32
    assert n % block_n == 0 and k % step == 0, "the lab kernel takes whole tiles only"
    tiles, steps = n // block_n, k // step
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
    splits = 1
    while steps % (splits * 2) == 0 and tiles * splits * 2 <= programs_per_sm * num_sms:
        splits *= 2
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    part = torch.empty(splits, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    counts = tqp.split_counts(x.device, tiles) if splits > 1 else out
    gemv_q8x_kernel[(tiles, splits)](x, w.words, w.scales, out, part, counts, n, k, k // splits, n, BLOCK_N=block_n,
                                     G=g, PARTIAL=splits > 1, EMULATE=INTERPRETED, num_warps=num_warps)
    return out


def reference(x: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the float64 matmul with x rounded as the kernel rounds it, the same with x as it is)."""
    from engine.quant import FORMATS

    w = FORMATS["Q4_1"].dequantize(blocks.cpu()).double()
    xk = x.float().cpu().reshape(-1, 32)
    dx = xk.abs().amax(dim=1, keepdim=True) / 127
    v = xk * torch.where(dx > 0, 1 / dx, 0.0)
    q = torch.where(v >= 0, torch.floor(v + 0.5), -torch.floor(0.5 - v))
    rounded = (q * dx).reshape(1, -1).double()
    return rounded @ w.t(), x.double().cpu() @ w.t()


def check(shapes, dev: str, dtype: torch.dtype, num_sms: int | None = None) -> list[dict]:
    """The kernel against reference() on each shape at two tiles (num_sms: as if on that many SMs,
    so that small shapes split K on a CPU too)."""
    from engine.quant.quantize import quantize_int4

    rows = []
    for n, k in shapes:
        gen = torch.Generator().manual_seed(n + k)
        blocks = quantize_int4(torch.randn(n, k, generator=gen) / k ** 0.5, 32).blocks
        x = torch.randn(1, k, generator=gen).to(dtype)
        packed = tqp.pack(blocks.to(dev), "Q4_1")
        want, unrounded = reference(x, blocks)
        for block_n, g in ((64, 8), (128, 16)):
            if n % block_n or k % (g * 32):
                continue
            got = gemv_q8x(x.to(dev), packed, block_n=block_n, g=g, num_sms=num_sms).double().cpu()
            scale = want.abs().max().item()
            err = (got - want).abs().max().item() / scale
            act = (unrounded - want).abs().max().item() / scale
            rows.append(dict(n=n, k=k, block_n=block_n, g=g, rel_err=err, activation_rounding_rel=act))
            print(f"check {n}x{k} tile {block_n}x{g * 32}: {err:.1e} from the rounded-x oracle "
                  f"(x's int8 rounding itself moves it {act:.1e})", flush=True)
            tolerance = 4e-3 if dtype == torch.bfloat16 else 2e-5  # bf16 output's rounding, else float32 sums
            assert err < tolerance, f"{n}x{k}: {err}"
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        check([(128, 1024), (256, 512)], "cpu", torch.float32)
        check([(128, 1024)], "cpu", torch.float32, num_sms=8)  # K split 2-4 ways
        return
    import packed_bench  # benchmarks/gpu, beside this script

    from engine.quant.quantize import quantize_int4

    results = dict(check=check(packed_bench.SHAPES, "cuda", torch.bfloat16), time=[])
    for n, k in packed_bench.SHAPES:
        blocks = quantize_int4(torch.randn(n, k) / k ** 0.5, 32).blocks.cuda()
        packed = tqp.pack(blocks, "Q4_1")
        copies = [tqp.PackedWeight(packed.words.clone(), packed.scales.clone(), "Q4_1")
                  for _ in range(packed_bench.copies(packed.nbytes))]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        base = packed_bench.graph_time_us([lambda q=q: tqp.packed_linear(x, q) for q in copies])
        row = dict(n=n, k=k, gemv_us=base, variants=[])
        for block_n in (64, 128, 256):
            for g in (8, 16):
                for warps in (4, 8):
                    for per_sm in (2, 4):
                        if n % block_n or k % (g * 32):
                            continue
                        try:
                            t = packed_bench.graph_time_us([
                                lambda q=q: gemv_q8x(x, q, block_n, g, warps, per_sm) for q in copies])
                        except Exception as e:  # noqa: BLE001 (a tile that does not compile: said, skipped)
                            print(f"  {n}x{k} {block_n}x{g} w{warps}: {type(e).__name__}: {e}"[:200], flush=True)
                            continue
                        row["variants"].append(dict(block_n=block_n, g=g, warps=warps, per_sm=per_sm, us=t))
        row["variants"].sort(key=lambda v: v["us"])
        best = row["variants"][0] if row["variants"] else None
        results["time"].append(row)
        print(f"{n}x{k}: gemv_kernel {base:.1f} us ({packed.nbytes / base / 1e3:.0f} GB/s); dp4a best "
              + (f"{best['us']:.1f} us ({packed.nbytes / best['us'] / 1e3:.0f} GB/s) {best}" if best else "none"),
              flush=True)
        del copies
        torch.cuda.empty_cache()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
