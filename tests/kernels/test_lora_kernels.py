"""Multi-LoRA shrink and expand of every backend (the torch reference, the C++ cpu library, Triton)
against a float64 definition computed token by token: odd ranks, up to 8 adapters in one batch,
tokens of the base model (slot -1) mixed in, fused projections (q/k/v's unequal slices, gate/up's
equal ones) and plain ones, 16-bit and float32, a row-strided x. Rows of slot -1 must leave y bit
for bit as it was.

Triton runs under the interpreter on CPU (tests/kernels/conftest.py), so its shapes stay small and
its largest cases are slow; past 64 tokens it takes its tiled kernels (test_triton_tiled_kernels
takes them at any size).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

import kernels
from kernels import cpu_build

HIDDEN = 100  # K: not a multiple of any vector width, so every dot product has a masked tail
QKV = (72, 24, 24)  # q, k, v of a GQA attention: three unequal slices, none a multiple of 64
GATE_UP = (56, 56)
PLAIN = (100,)
# Unit roundoff of each output dtype (y is rounded twice: the LoRA sum to y's dtype, then the add).
ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
FLOAT32_SUMS = 1e-5  # relative error of float32 sums of at most a few hundred terms, generously


def cpu_lora_or_skip() -> None:
    try:
        cpu_build.load_lora()
    except RuntimeError as e:
        pytest.skip(f"CPU LORA KERNELS NOT TESTED: they did not build ({e})")


@pytest.fixture(params=["torch", "cpu", "triton"])
def backend(request):
    """A backend name whose kernels run here, or a skip saying why not."""
    if request.param == "cpu":
        cpu_lora_or_skip()
    if request.param == "triton":
        request.getfixturevalue("triton_ops")
    return request.param


def device_for(backend: str) -> str:
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def make_slots(tokens: int, slots: int, pattern: str, gen: torch.Generator) -> torch.Tensor:
    """mixed: adapters and the base model (-1); none: every token has an adapter; all: none has."""
    if pattern == "all":
        return torch.full((tokens,), -1, dtype=torch.int32)
    low = -1 if pattern == "mixed" else 0
    return torch.randint(low, slots, (tokens,), generator=gen, dtype=torch.int32)


def shrink64(x, lora_a, token_slots) -> torch.Tensor:
    """The definition, one token at a time in float64."""
    out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float64)
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            out[t] = lora_a[slot].double() @ x[t].double()
    return out


def expand64(y, buf, lora_b, token_slots, out_slices) -> torch.Tensor:
    """y + the LoRA delta, one token and slice at a time in float64."""
    out, rank = y.double().clone(), lora_b.shape[2]
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        offset = 0
        for i, size in enumerate(out_slices):
            part = buf[t, i * rank:(i + 1) * rank].double()
            out[t, offset:offset + size] += lora_b[slot, offset:offset + size].double() @ part
            offset += size
    return out


def make_case(tokens, rank, out_slices, pattern, dtype, slots=8, seed=0, strided=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN + 24 if strided else HIDDEN, generator=gen)
    if strided:
        x = x[:, 8:8 + HIDDEN]  # a view into wider rows: row stride 124, offset 8
    lora_a = torch.randn(slots, len(out_slices) * rank, HIDDEN, generator=gen) / HIDDEN ** 0.5
    lora_b = torch.randn(slots, sum(out_slices), rank, generator=gen) / rank ** 0.5
    y = torch.randn(tokens, sum(out_slices), generator=gen)
    return x.to(dtype), lora_a.to(dtype), lora_b.to(dtype), y.to(dtype), make_slots(tokens, slots, pattern, gen)


def check_expanded(got, want, magnitude, y0, token_slots, dtype, chained=1.0):
    """Within the two roundings to y's dtype and float32 summation (chained: the shrink's error too);
    rows of slot -1 exactly y0."""
    u = ROUNDOFF[dtype]
    bound = u * (want.abs() + magnitude) + u * 1e-3 + FLOAT32_SUMS * chained * magnitude
    err = (got.cpu().double() - want).abs()
    assert (err <= bound).all(), f"max error {err.max():.3g}, worst excess {(err - bound).max():.3g}"
    base = token_slots < 0
    assert torch.equal(got.cpu()[base], y0[base]), "a token of slot -1 changed y"


def run_case(backend, tokens, rank, out_slices, pattern, dtype, slots=8, strided=False):
    x, lora_a, lora_b, y0, token_slots = make_case(tokens, rank, out_slices, pattern, dtype, slots, strided=strided)
    device = device_for(backend)
    on = [t.to(device) if device != "cpu" else t for t in (x, lora_a, lora_b, token_slots)]
    if strided and device != "cpu":
        on[0] = torch.empty(tokens, HIDDEN + 24, dtype=dtype, device=device)[:, 8:8 + HIDDEN].copy_(x)
    dx, da, db, ds = on
    # shrink
    buf = kernels.lora_shrink(dx, da, ds, backend=backend)
    assert buf.dtype == torch.float32 and buf.shape == (tokens, len(out_slices) * rank)
    want_buf = shrink64(x, lora_a, token_slots)
    buf_magnitude = shrink64(x.abs(), lora_a.abs(), token_slots)
    err = (buf.cpu().double() - want_buf).abs()
    assert (err <= FLOAT32_SUMS * buf_magnitude).all(), f"shrink: max error {err.max():.3g}"
    assert not buf.cpu()[token_slots < 0].any(), "shrink: a token of slot -1 has a nonzero row"
    # expand of a given float32 buffer
    given = torch.randn(tokens, len(out_slices) * rank, generator=torch.Generator().manual_seed(1))
    y = y0.to(device).clone()
    assert kernels.lora_expand(y, given.to(device), db, ds, out_slices, backend=backend) is None
    check_expanded(y, expand64(y0, given, lora_b, token_slots, out_slices),
                   expand64(torch.zeros_like(y0), given.abs(), lora_b.abs(), token_slots, out_slices),
                   y0, token_slots, dtype)
    # shrink then expand, against the whole chain in float64
    y = y0.to(device).clone()
    kernels.lora_expand(y, kernels.lora_shrink(dx, da, ds, backend=backend), db, ds, out_slices, backend=backend)
    check_expanded(y, expand64(y0, want_buf, lora_b, token_slots, out_slices),
                   expand64(torch.zeros_like(y0), buf_magnitude, lora_b.abs(), token_slots, out_slices),
                   y0, token_slots, dtype, chained=2.0)


# (tokens, rank, out_slices, slot pattern): every rank, slice layout, token count and pattern is met
# several times, each with the others varied, rather than their whole product.
CASES = [
    (1, 16, QKV, "mixed"), (1, 1, PLAIN, "none"), (1, 64, GATE_UP, "none"), (1, 7, QKV, "all"),
    (5, 3, GATE_UP, "mixed"), (5, 7, QKV, "none"), (5, 64, PLAIN, "mixed"), (5, 1, QKV, "mixed"),
    (37, 7, PLAIN, "mixed"), (37, 64, QKV, "mixed"), (37, 16, GATE_UP, "all"), (37, 1, GATE_UP, "none"),
    (37, 3, QKV, "none"),
    (300, 16, QKV, "mixed"), (300, 3, GATE_UP, "mixed"), (300, 64, PLAIN, "none"), (300, 7, QKV, "all"),
]


def _params():
    for backend in ("torch", "cpu", "triton"):
        for case in CASES:
            tokens, rank, out_slices, _ = case  # the interpreter's time grows with tokens x buffer columns
            slow = backend == "triton" and tokens * rank * len(out_slices) > 4096
            marks = [pytest.mark.slow] if slow else []
            yield pytest.param(backend, *case, marks=marks, id=f"{backend}-{case[0]}tok-r{case[1]}-"
                               f"{len(case[2])}slice-{case[3]}")


@pytest.mark.parametrize("backend,tokens,rank,out_slices,pattern", _params(), indirect=["backend"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_shrink_and_expand_match_float64(backend, tokens, rank, out_slices, pattern, dtype):
    run_case(backend, tokens, rank, out_slices, pattern, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "fp32", "fp16"])
def test_row_strided_x(backend, dtype):
    run_case(backend, 5, 7, QKV, "mixed", dtype, strided=True)


@pytest.mark.parametrize("tokens,rank,out_slices,pattern", [(5, 7, QKV, "mixed"), (37, 16, GATE_UP, "mixed"),
                                                          (37, 3, PLAIN, "none"), (20, 1, QKV, "all"),
                                                          (9, 3, (16, 8, 24, 8, 40), "mixed")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_triton_tiled_kernels(triton_ops, monkeypatch, tokens, rank, out_slices, pattern, dtype):
    # Prefill chunks take tiles of consecutive tokens, one tl.dot per slot in a tile; here at any token count.
    from kernels import triton_lora

    monkeypatch.setattr(triton_lora, "TILED_TOKENS", 0)
    run_case("triton", tokens, rank, out_slices, pattern, dtype)


def test_one_adapter_slot(backend):
    run_case(backend, 37, 16, GATE_UP, "mixed", torch.bfloat16, slots=1)


def test_more_slices_than_one_launch_takes(backend):
    # Triton's expand handles up to four slices a launch; five take two.
    run_case(backend, 5, 3, (16, 8, 24, 8, 40), "mixed", torch.float32)


def test_every_adapter_of_eight_in_one_batch(backend):
    x, lora_a, lora_b, y0, _ = make_case(16, 16, QKV, "mixed", torch.float32)
    token_slots = torch.tensor([7, -1, 0, 3, 1, -1, 6, 2, 5, 4, 0, -1, 7, 3, 3, -1], dtype=torch.int32)
    device = device_for(backend)
    y = y0.to(device).clone()
    buf = kernels.lora_shrink(x.to(device), lora_a.to(device), token_slots.to(device), backend=backend)
    kernels.lora_expand(y, buf, lora_b.to(device), token_slots.to(device), QKV, backend=backend)
    want = expand64(y0, shrink64(x, lora_a, token_slots), lora_b, token_slots, QKV)
    assert torch.allclose(y.cpu().double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(y.cpu()[token_slots < 0], y0[token_slots < 0])


def test_cpu_results_do_not_depend_on_the_thread_count():
    # Each output is one thread's work in a fixed order, so a team of any size gives the same bits.
    cpu_lora_or_skip()
    x, lora_a, lora_b, y0, token_slots = make_case(300, 16, QKV, "mixed", torch.bfloat16)
    threads, outputs = torch.get_num_threads(), []
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            y = y0.clone()
            buf = kernels.lora_shrink(x, lora_a, token_slots, backend="cpu")
            kernels.lora_expand(y, buf, lora_b, token_slots, QKV, backend="cpu")
            outputs.append((buf, y))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])


def test_cpu_rejects_a_slot_past_the_weights():
    cpu_lora_or_skip()
    x, lora_a, lora_b, y, _ = make_case(3, 4, PLAIN, "mixed", torch.float32, slots=2)
    bad = torch.tensor([0, 2, -1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="adapter slot 2"):
        kernels.lora_shrink(x, lora_a, bad, backend="cpu")
    with pytest.raises(RuntimeError, match="adapter slot 2"):
        kernels.lora_expand(y, torch.zeros(3, 4), lora_b, bad, PLAIN, backend="cpu")


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["DEFAULT", "AVX2"])
def test_narrower_cpu_builds(isa):
    # The AVX-512 build loads partial vectors under masks; AVX2's and the portable one take other
    # paths for the same tails: each builds (about 30 s) and passes the fast cpu cases.
    cpu_lora_or_skip()
    if isa == "AVX2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU has no AVX2")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "ATEN_CPU_CAPABILITY": isa.lower()}
    check = ("import sys, torch; assert torch.backends.cpu.get_cpu_capability() == sys.argv[1]; import pytest; "
             "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-m', 'not slow', '-k', 'cpu', sys.argv[2]]))")
    out = subprocess.run([sys.executable, "-c", check, isa, os.path.abspath(__file__)], env=env, cwd=root,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def test_an_engine_start_leaves_the_lora_library_unbuilt(monkeypatch):
    # start_building (an engine on a CPU, while its model loads) builds the two libraries every model
    # needs; the LoRA one waits for the first LoRA call, so serving without adapters never compiles it.
    started = []

    class RunNow:
        def __init__(self, target, args, **kwargs):
            self.target, self.args = target, args

        def start(self):
            self.target(*self.args)

    monkeypatch.setattr(cpu_build, "threading", types.SimpleNamespace(Thread=RunNow))
    monkeypatch.setattr(cpu_build, "_quietly", lambda library: started.append(library.source.name))
    for library in (cpu_build._OPS, cpu_build._QUANT, cpu_build._LORA):
        monkeypatch.setattr(library, "module", None)
        monkeypatch.setattr(library, "error", None)
    cpu_build.start_building()
    assert started == ["cpu_ops.cpp", "cpu_quant.cpp"]


@pytest.mark.slow
def test_cpu_bench_lora_rows(tmp_path):
    # `python -m kernels.cpu_bench --lora` times every projection at both batch sizes (its numbers are
    # benchmarks, not asserted here).
    cpu_lora_or_skip()
    from kernels import cpu_bench

    out = tmp_path / "lora.json"
    assert cpu_bench.main(["--lora", "--runs", "1", "--dtype", "float32", "--output-json", str(out)]) == 0
    rows = json.loads(out.read_text())["lora"]
    assert len(rows) == 2 * 2 * 4  # two models, two token counts, four projections
    assert all(r["linear_ms"] > 0 and r["cpu_ms"] > 0 and r["torch_ms"] > 0 for r in rows)
