"""GGUF block-quantized matmuls (kernels/cpu_quant.cpp, engine/quant) against their oracle:
gguf.quants.dequantize, then a float64 matmul. BF16 (a bfloat16 matrix as stored, which the same
kernels widen) is checked alongside, against gguf's own BF16 rows."""

from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from engine.quant import AS_STORED, FORMATS, QuantizedTensor, reference_linear
from kernels import cpu_build, cpu_quant
from tests.kernels.gguf_blocks import quantize

BLOCK_FORMATS = AS_STORED  # what the CPU kernels read
FORMAT_NAMES = sorted(BLOCK_FORMATS)
# Byte ranges of each format's fp16 scales/mins: random blocks get finite values there.
FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}


def _k(fmt: str, blocks: int) -> int:
    """in_features of `blocks` whole blocks (K-quants: super-blocks of 256)."""
    return blocks * BLOCK_FORMATS[fmt].block_size


def _weight(fmt: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(GGUF blocks uint8 [n, row bytes], their dequantized float32 [n, k]) of a random matrix."""
    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32)
    w[: n // 2] *= 0.01  # rows of small scales too: fp16 scales near their subnormal range
    blocks = quantize(w, fmt)
    return torch.from_numpy(blocks.copy()), torch.from_numpy(dequantize(blocks, GGMLQuantizationType[fmt]).copy())


def _random_blocks(fmt: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Like _weight, but every byte random (each bit of every packed field set both ways) save the
    fp16 fields, which hold random finite values (normal and subnormal)."""
    rng = np.random.default_rng(seed)
    if fmt == "BF16":  # every field is a bfloat16: random finite values, normal and subnormal
        vals = rng.standard_normal((n, k)) * 10.0 ** rng.integers(-40, 3, (n, k))
        blocks = torch.from_numpy(vals.astype(np.float32)).bfloat16().view(torch.uint8).contiguous()
        return blocks, torch.from_numpy(dequantize(blocks.numpy(), GGMLQuantizationType.BF16).copy())
    f = FORMATS[fmt]
    blocks = rng.integers(0, 256, (n, k // f.block_size, f.block_bytes), dtype=np.uint8)
    for offset in FP16_FIELDS[fmt]:
        magnitude = 10.0 ** rng.integers(-7, 0, blocks.shape[:2])
        half = (rng.standard_normal(blocks.shape[:2]) * magnitude).astype(np.float16)
        blocks[..., offset:offset + 2] = half.view(np.uint8).reshape(*blocks.shape[:2], 2)
    blocks = blocks.reshape(n, -1)
    return torch.from_numpy(blocks), torch.from_numpy(dequantize(blocks, GGMLQuantizationType[fmt]).copy())


def _cpu_kernels_or_skip():
    error = None
    try:
        cpu_build.load_quant()
    except RuntimeError as e:
        error = e
    if error is not None:
        pytest.skip(f"quantized CPU kernels unavailable: {error}")


def test_formats_agree_with_gguf_and_the_cpu_kernels():
    """One block size and byte count per format: engine.quant's, the C++ kernels' and GGUF's."""
    assert set(cpu_quant.FORMATS) == set(BLOCK_FORMATS)
    for name, f in BLOCK_FORMATS.items():
        size, nbytes = gguf.GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        if name == "BF16":  # GGUF's unit is one weight; the kernels read 32 at a time
            size, nbytes = size * f.block_size, nbytes * f.block_size
        assert (size, nbytes) == (f.block_size, f.block_bytes), name
        assert cpu_quant.FORMATS[name][1:] == (f.block_size, f.block_bytes), name


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K"])
def test_k_quant_test_blocks_are_what_gguf_reads(fmt):
    """The test quantizer (gguf.quants cannot quantize K-quants) writes the layout gguf reads: its
    blocks dequantize, by gguf, to the weights within the format's rounding."""
    w = np.random.default_rng(3).standard_normal((4, 512), dtype=np.float32)
    got = dequantize(quantize(w, fmt), GGMLQuantizationType[fmt])
    rel_rms = np.sqrt(((got - w) ** 2).mean() / (w ** 2).mean())
    assert rel_rms < {"Q4_K": 0.1, "Q6_K": 0.025}[fmt]


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("make", [_weight, _random_blocks])
def test_torch_dequantize_is_gguf_bit_for_bit(fmt, make):
    blocks, want = make(fmt, 7, _k(fmt, 3))
    got = BLOCK_FORMATS[fmt].dequantize(blocks)
    assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("make", [_weight, _random_blocks])
def test_cpu_dequantize_matches_gguf(fmt, make):
    _cpu_kernels_or_skip()
    blocks, want = make(fmt, 19, _k(fmt, 5))
    assert torch.equal(cpu_quant.dequantize(blocks, fmt), want)
    assert torch.equal(cpu_quant.dequantize(blocks, fmt, torch.bfloat16), want.bfloat16())


def _tolerance(x: torch.Tensor, w: torch.Tensor, rel: float) -> torch.Tensor:
    """rel * (|x| @ |w|^T): the error bound of a dot product whose terms are each off by rel."""
    return rel * (x.abs().double() @ w.abs().double().T) + 1e-6


# Activation rows: each remainder of the kernel's groups of 4 (1..5), a group of 8 then 3 (11), its
# most (DEQUANT_GEMM_ROWS: two groups of 8), and above it (the tiled and dequantize-then-GEMM paths).
ROWS = (1, 2, 3, 4, 5, 11, cpu_quant.DEQUANT_GEMM_ROWS, cpu_quant.DEQUANT_GEMM_ROWS + 1, 64)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nblocks", [1, 3, 19])
def test_cpu_linear_matches_dequantized_reference(fmt, dtype, nblocks):
    _cpu_kernels_or_skip()
    n, k = 37, _k(fmt, nblocks)  # n odd: a partial last work item of output rows
    blocks, w = _weight(fmt, n, k, seed=k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype)
    for m in ROWS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        got = cpu_quant.linear(x, blocks, fmt, bias)
        want = x.double() @ w.double().T + bias.double()
        assert got.dtype == dtype and got.shape == (m, n)
        # float32: summation order only. bfloat16: the output's rounding, and above
        # DEQUANT_GEMM_ROWS the weights' rounding to bfloat16 for the GEMM.
        rel = 1e-5 if dtype == torch.float32 else 2 * 2.0 ** -8
        assert ((got.double() - want).abs() <= _tolerance(x, w, rel) + rel * bias.double().abs()).all(), (m, fmt)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_tiled_bf16_kernel_matches_dequantized_reference(fmt):
    """linear_bf16_tiled at shapes the linear test above does not reach: several tiles of 64 weight
    rows plus a tail that is not a multiple of 16 (150 = 64 + 64 + 16 + 6), and activation rows past
    one brgemm call of 32 (33) and past TILED_GEMM_ROWS (150: what an LM head takes there)."""
    _cpu_kernels_or_skip()
    if not cpu_quant.has_brgemm_bf16():
        pytest.skip("no bf16 brgemm on this CPU: bfloat16 rows above DEQUANT_GEMM_ROWS dequantize the whole weight")
    n, k = 150, _k(fmt, 3)
    blocks, w = _weight(fmt, n, k, seed=n)
    for m in (17, 33, 150):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        got = cpu_build.load_quant().linear_bf16_tiled(x, blocks, cpu_quant.FORMATS[fmt].id)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        # the weights' rounding to bfloat16, then the output's
        assert ((got.double() - x.double() @ w.double().T).abs() <= _tolerance(x, w, 2 * 2.0 ** -8)).all(), (m, fmt)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliced_gemm_matches_dequantized_reference(fmt, dtype, monkeypatch):
    """Rows past the register kernel where oneDNN's GEMM takes them (bf16: AVX512_BF16 without
    brgemm; float32: AVX-512 without AMX, Zen 4/5): the weight is dequantized in slices. A slice of
    20 weight rows here (37 = 20 + 17), so the slices' seams and the bias are checked at a small shape."""
    _cpu_kernels_or_skip()
    takes = (not cpu_quant.has_brgemm_bf16() and cpu_quant.native_bf16_matmul() if dtype == torch.bfloat16
             else cpu_quant.onednn_float32())
    if not takes:
        pytest.skip(f"{dtype} rows past the register kernel take another path on this CPU")
    n, k = 37, _k(fmt, 2)
    blocks, w = _weight(fmt, n, k, seed=n)
    monkeypatch.setattr(cpu_quant, "GEMM_SLICE_BYTES", 20 * k * (2 if dtype == torch.bfloat16 else 4))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype)
    for m in (cpu_quant.DEQUANT_GEMM_ROWS + 1, 64):
        x = torch.randn(2, m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        got = cpu_quant.linear(x, blocks, fmt, bias)
        want = x.double() @ w.double().T + bias.double()
        assert got.dtype == dtype and got.shape == (2, m, n)
        # float32: summation order only; bf16: the weights' rounding to bf16, then the output's
        rel = 1e-5 if dtype == torch.float32 else 2 * 2.0 ** -8
        bound = _tolerance(x.reshape(-1, k), w, rel).reshape(2, m, n) + rel * bias.double().abs()
        assert ((got.double() - want).abs() <= bound).all(), (m, fmt)


@pytest.mark.parametrize(("fmt", "n"), [(fmt, 150) for fmt in FORMAT_NAMES]
                         + [("Q4_1", n) for n in (133, 131, 130, 129)])
def test_tiled_f32_kernel_matches_dequantized_reference(fmt, n):
    """linear_f32_tiled (float32 rows above DEQUANT_GEMM_ROWS, up to TILED_GEMM_ROWS): several tiles of
    64 weight rows and a partial one (150 = 64 + 64 + 22; the others end in 5, 3, 2 and 1 rows, so
    the AVX2 micro-kernel's tails of 1-5 weight rows all run), activation rows that fill its slabs
    of 16 or leave 1 or 15 over, rows on both sides of the switch to dequantize-then-GEMM, and
    through cpu_quant.linear with a bias."""
    _cpu_kernels_or_skip()
    k = _k(fmt, 3)
    blocks, w = _weight(fmt, n, k, seed=n)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    for m in (cpu_quant.DEQUANT_GEMM_ROWS + 1, 31, 64, cpu_quant.TILED_GEMM_ROWS, cpu_quant.TILED_GEMM_ROWS + 1):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        want = x.double() @ w.double().T
        got = cpu_build.load_quant().linear_f32_tiled(x, blocks, cpu_quant.FORMATS[fmt].id)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        assert ((got.double() - want).abs() <= _tolerance(x, w, 1e-5)).all(), (m, fmt)
        got = cpu_quant.linear(x, blocks, fmt, bias)
        assert ((got.double() - want - bias.double()).abs() <= _tolerance(x, w, 1e-5) + 1e-6).all(), (m, fmt)


def test_lm_head_sized_weight_past_the_register_rows():
    """A weight of TILED_GEMM_WEIGHTS or more (an LM head) takes the tiled kernel from
    LARGE_REGISTER_ROWS + 1 bf16 rows; both sides of the switch match the reference."""
    _cpu_kernels_or_skip()
    from engine.quant.quantize import quantize_int8

    n, k = cpu_quant.TILED_GEMM_WEIGHTS // 512, 512
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0))
    blocks = quantize_int8(w).blocks
    wd = FORMATS["Q8_0"].dequantize(blocks)
    for m in (cpu_quant.LARGE_REGISTER_ROWS, cpu_quant.LARGE_REGISTER_ROWS + 1):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        got = cpu_quant.linear(x, blocks, "Q8_0")
        assert ((got.double() - x.double() @ wd.double().T).abs() <= _tolerance(x, wd, 2 * 2.0 ** -8)).all(), m


def test_bf16_matrix_past_the_register_rows(monkeypatch):
    """A layer's BF16 matrix under bf16 rows, on a CPU with bf16 dot products: up to DEQUANT_GEMM_ROWS rows
    take the dot kernel, up to BF16_OUTER_ROWS linear_bf16_outer, more oneDNN's GEMM on the matrix as
    stored (F.linear handed the blocks' own storage, no copy); each matches the float64 product within the
    output's rounding."""
    _cpu_kernels_or_skip()
    if not cpu_quant.has_bf16_dots() or cpu_quant.has_brgemm_bf16():
        pytest.skip("for CPUs with bf16 dot products and no bf16 brgemm (AVX512_BF16 without AMX)")
    n, k = 101, 576
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)).bfloat16()
    blocks = w.view(torch.uint8)
    handed = []
    linear = cpu_quant.F.linear

    def spy(x, weight, bias=None):
        handed.append(weight)
        return linear(x, weight, bias)

    monkeypatch.setattr(cpu_quant.F, "linear", spy)
    for m in (cpu_quant.DEQUANT_GEMM_ROWS, cpu_quant.DEQUANT_GEMM_ROWS + 1, cpu_quant.BF16_OUTER_ROWS,
              cpu_quant.BF16_OUTER_ROWS + 1):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        got = cpu_quant.linear(x, blocks, "BF16")
        assert ((got.double() - x.double() @ w.double().T).abs() <= _tolerance(x, w.float(), 2.0 ** -8)).all(), m
        assert len(handed) == (m > cpu_quant.BF16_OUTER_ROWS), m
    assert handed[0].data_ptr() == blocks.data_ptr()


@pytest.mark.parametrize("n", [32, 101, 160])
def test_bf16_outer_kernel_matches_the_float64_product(n):
    """linear_bf16_outer: whole blocks of 32 weight rows (two transposed blocks of 16) and a tail the dot
    kernel takes (101 = 3 x 32 + 5), activation rows in every group it forms (12s, 4s, 1-3)."""
    _cpu_kernels_or_skip()
    if not cpu_quant.has_bf16_dots():
        pytest.skip("no AVX512_BF16 here")
    k = 96
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)).bfloat16()
    for m in (1, 3, 4, 7, 12, 13, 29, 64):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        got = cpu_build.load_quant().linear_bf16_outer(x, w.view(torch.uint8))
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        assert ((got.double() - x.double() @ w.double().T).abs() <= _tolerance(x, w.float(), 2.0 ** -8)).all(), m


def test_cpu_linear_takes_leading_dims():
    _cpu_kernels_or_skip()
    for fmt in ("Q4_1", "Q6_K"):
        blocks, w = _weight(fmt, 5, _k(fmt, 2))
        x = torch.randn(2, 3, w.shape[1], generator=torch.Generator().manual_seed(3))
        # float64 oracle: oneDNN's float32 product is itself 2e-5 off at K = 512 on some CPUs (Zen 5)
        exact = (x.double() @ w.double().T).float()
        torch.testing.assert_close(cpu_quant.linear(x, blocks, fmt), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind, levels", [("int8", 127), ("int16", 32767)])
@pytest.mark.parametrize("fmt", cpu_quant.Q8_FORMATS)
def test_integer_activation_kernels_within_their_rounding(fmt, kind, levels):
    """linear_q8 / linear_q16 (activations scaled to int8 / int16 per block, integer dots) are off
    from the float64 product by the activations' rounding only: at most half a quantization step
    (block amax / levels / 2) per activation; 1 to 5 rows, each quantized on its own."""
    _cpu_kernels_or_skip()
    if not cpu_quant.takes_activations("Q4_1", kind) and kind == "int16":
        pytest.skip("linear_q16 is built for AVX2 only")
    kernel = cpu_quant.linear_q16 if kind == "int16" else cpu_quant.linear_q8
    blocks, w = _weight(fmt, 33, 160)
    x = torch.randn(5, 160, generator=torch.Generator().manual_seed(5))
    step = x.reshape(5, -1, 32).abs().amax(-1, keepdim=True).expand(-1, -1, 32).reshape(5, 160) / levels
    bound = (step.double() / 2 + 1e-6 * x.abs().double()) @ w.abs().double().T + 1e-5
    exact = x.double() @ w.double().T
    got = kernel(x, blocks, fmt)
    assert ((got.double() - exact).abs() <= bound).all()
    for m in (1, 3):  # fewer rows: the same numbers row by row
        torch.testing.assert_close(kernel(x[:m], blocks, fmt), got[:m], rtol=0, atol=0)
    # and what the engine calls: this kernel up to ACTIVATION_ROWS rows (bfloat16 activations too),
    # float activations above (where the float kernel is faster)
    rows = cpu_quant.ACTIVATION_ROWS[kind]
    assert 1 <= rows < cpu_quant.DEQUANT_GEMM_ROWS
    xs = torch.randn(rows + 1, 160, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(cpu_quant.linear(xs[:rows], blocks, fmt, activations=kind),
                               kernel(xs[:rows], blocks, fmt), rtol=0, atol=0)
    torch.testing.assert_close(cpu_quant.linear(xs, blocks, fmt, activations=kind),
                               cpu_quant.load_quant().linear_f32(xs, blocks, cpu_quant.FORMATS[fmt].id), rtol=0, atol=0)
    got16 = cpu_quant.linear(xs[:rows].bfloat16(), blocks, fmt, activations=kind)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16, kernel(xs[:rows].bfloat16().float(), blocks, fmt).bfloat16(), rtol=0, atol=0)


def test_cpu_linear_rejects_a_misshapen_weight():
    _cpu_kernels_or_skip()
    blocks, _ = _weight("Q8_0", 4, 64)
    with pytest.raises(RuntimeError, match="row"):
        cpu_quant.linear(torch.randn(1, 96), blocks, "Q8_0")
    with pytest.raises(ValueError, match="supported"):
        cpu_quant.linear(torch.randn(1, 64), blocks, "Q5_0")
    k_blocks, _ = _weight("Q4_K", 4, 256)
    with pytest.raises(RuntimeError, match="block of 256"):
        cpu_quant.linear(torch.randn(1, 288), k_blocks, "Q4_K")
    with pytest.raises(ValueError, match="linear_q8 reads"):
        cpu_quant.linear_q8(torch.randn(1, 256), k_blocks, "Q4_K")


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_format_linear_per_backend(fmt):
    """The torch backend's matmul is the reference itself; the cpu backend's agrees with it."""
    k = _k(fmt, 2)
    blocks, w = _weight(fmt, 9, k)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(2))
    fmt = BLOCK_FORMATS[fmt]
    torch.testing.assert_close(fmt.linear(x, blocks, None, "torch"), x @ w.T, rtol=0, atol=0)
    torch.testing.assert_close(reference_linear(x, blocks, fmt), x @ w.T, rtol=0, atol=0)
    exact = (x.double() @ w.double().T).float()  # float32's own product is 2e-5 off at K = 512 on Zen 5
    torch.testing.assert_close(fmt.linear(x, blocks, None, "cpu"), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_quantized_tensor_narrows_on_whole_blocks(fmt):
    bs = BLOCK_FORMATS[fmt].block_size
    blocks, w = _weight(fmt, 6, 4 * bs)
    t = QuantizedTensor(blocks, BLOCK_FORMATS[fmt])
    assert t.shape == (6, 4 * bs)
    assert torch.equal(t.narrow(0, 2, 3).dequantize(), w[2:5])
    assert torch.equal(t.narrow(1, 2 * bs, 2 * bs).dequantize(), w[:, 2 * bs:])
    unit = "super-blocks of 256" if bs == 256 else "blocks of 32"
    with pytest.raises(ValueError, match=f"whole {unit}"):
        t.narrow(1, 32 if bs == 256 else 16, 2 * bs)


# The narrower builds: the same checks in a process whose torch reports a lesser vector ISA (AVX2,
# or none: the portable path), so kernels/cpu_build.py compiles cpu_quant.cpp for it (a build of
# its own, ~1 min each).
_PORTABLE_CHECK = """
import sys
import torch
assert torch.backends.cpu.get_cpu_capability() == sys.argv[1], torch.backends.cpu.get_cpu_capability()
from tests.kernels import test_quant_kernels as t
from kernels import cpu_quant
for fmt in t.FORMAT_NAMES:
    blocks, w = t._random_blocks(fmt, 19, t._k(fmt, 3))
    assert torch.equal(cpu_quant.dequantize(blocks, fmt), w), fmt
    assert torch.equal(cpu_quant.dequantize(blocks, fmt, torch.bfloat16), w.bfloat16()), fmt
    blocks, w = t._weight(fmt, 37, t._k(fmt, 3))
    for m in t.ROWS:
        x = torch.randn(m, w.shape[1])
        err = (cpu_quant.linear(x, blocks, fmt).double() - x.double() @ w.double().T).abs()
        assert (err <= t._tolerance(x, w, 1e-5)).all(), (fmt, m)
    if fmt in cpu_quant.Q8_FORMATS:  # integer activations: the scalar and AVX2 dot products
        t.test_integer_activation_kernels_within_their_rounding(fmt, "int8", 127)
        if sys.argv[1] == "AVX2":
            t.test_integer_activation_kernels_within_their_rounding(fmt, "int16", 32767)
print("portable ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["DEFAULT", "AVX2"])
def test_narrower_builds_match_dequantized_reference(isa):
    _cpu_kernels_or_skip()
    if isa == "AVX2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU has no AVX2")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": isa.lower()}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _PORTABLE_CHECK, isa], env=env, cwd=root, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and "portable ok" in out.stdout, out.stderr[-3000:]


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q6_K"])
def test_the_helper_pool_gives_the_teams_bits(fmt):
    """cpu_build.set_helpers(n): the caller and n helpers of the extension's own take each loop's
    chunks (a helper the scheduler has not run takes none: the caller never waits for it). Every
    output row is one thread's work either way, so the results are bit for bit those of torch's
    OpenMP team, at one row, a few (the register kernels), 64 (the tiles, or the dequantized GEMM in
    slices), in float32 and bf16, with the int16 / int8 activation kernels too; and set_helpers(0)
    gives the team back."""
    _cpu_kernels_or_skip()
    quant = cpu_build.load_quant()
    blocks, _ = _weight(fmt, 200, _k(fmt, 4), seed=3)
    threads = torch.get_num_threads()
    cases = [(m, dtype, act) for m in (1, 3, 9, 64) for dtype in (torch.float32, torch.bfloat16)
             for act in (None, "int16", "int8") if act is None or m <= 16]
    want = []
    for m, dtype, act in cases:
        x = torch.randn(m, blocks.shape[1] // FORMATS[fmt].block_bytes * FORMATS[fmt].block_size,
                        generator=torch.Generator().manual_seed(m)).to(dtype)
        try:
            want.append(((m, dtype, act), x, cpu_quant.linear(x, blocks, fmt, None, act)))
        except RuntimeError:  # an activation kernel this CPU's build lacks (linear_q16: AVX2 only)
            pass
    assert len(want) >= 8
    try:
        torch.set_num_threads(1)
        cpu_build.set_helpers(max(1, threads - 1))
        assert quant.helpers() == max(1, threads - 1)
        for (m, dtype, act), x, expected in want:
            assert torch.equal(cpu_quant.linear(x, blocks, fmt, None, act), expected), (m, dtype, act)
    finally:
        cpu_build.set_helpers(0)
        torch.set_num_threads(threads)
    assert quant.helpers() == 0


def test_starting_helpers_leaves_torchs_thread_count():
    """A helper thread must not touch torch's thread count, which is the whole process's (a fresh
    process: helpers start once per process)."""
    _cpu_kernels_or_skip()
    code = ("import time, torch; from kernels.cpu_build import load_quant; torch.set_num_threads(2); "
            "load_quant().set_helpers(2); time.sleep(0.5); print(torch.get_num_threads(), load_quant().helpers())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "2"]
