"""The C++ CPU kernels (kernels/cpu_ops.cpp) against a float64 definition and kernels/reference.py.

Attention batches come from kernel_cases: shuffled blocks, padding entries in the block tables and
NaN in every cache slot outside a sequence, copied into the cpu backend's own cache layout.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from kernels import cpu_build, reference
from tests.kernels.kernel_cases import check_attention, make_batch, to_cpu_layout

if cpu_build.available() is not None:
    pytest.skip(f"CPU KERNELS NOT TESTED: they did not build ({cpu_build.available()})", allow_module_level=True)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def run(b) -> None:
    want = reference.paged_attention(*b.args())
    b = to_cpu_layout(b)
    out = kernels.paged_attention(*b.args(), backend="cpu")
    # Rows past the last sequence are a padded step's padding rows: zeros, whatever the memory
    # held (check_attention then wants them NaN, as for a caller's buffer).
    assert bool((out[b.num_tokens:] == 0).all())
    out[b.num_tokens:] = float("nan")
    check_attention(out, b, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_token(dtype):
    run(make_batch([1], [1], dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decodes_across_block_boundaries(dtype, block_size):
    lens = [1, 15, 16, 17, 31, 32, 33, 300]
    run(make_batch([1] * len(lens), lens, block_size=block_size, dtype=dtype, seed=block_size))


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8])
def test_gqa_ratios(group):
    # Up to 4 heads share one register pass; 5 and 8 take two.
    run(make_batch([1, 1, 1], [40, 7, 70], group=group, dtype=torch.bfloat16, seed=group))


@pytest.mark.parametrize("head_dim", [8, 16, 24, 64, 80, 128])
def test_head_dims(head_dim):
    # 8 and 24 are not whole vectors: partial loads and stores.
    run(make_batch([1, 1], [50, 19], num_kv_heads=1, group=3, head_dim=head_dim, dtype=torch.float32, seed=head_dim))


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_batch_with_strided_query(dtype):
    # Decodes among prefill chunks (one after a cached prefix ending mid-block, one a whole
    # prompt), each prefill row causal over its own sequence, padding rows after the last.
    b = make_batch([1, 7, 1, 30, 1], [90, 21 + 7, 1, 30, 17], strided_query=True, dtype=dtype, pad_rows=2)
    run(b)


def test_sequence_without_new_queries():
    # As many rows as sequences, yet not one row each: a sequence with no new query this step.
    run(make_batch([0, 2, 1], [5, 7, 9], seed=2))


def test_plan_rows_name_each_rows_sequence_and_keys():
    """Per query row: its sequence and its key count (its position + 1), counted by hand for a
    decode, a chunk continuing a cached prefix, a sequence with no query and a whole prompt."""
    from kernels import cpu_ops

    starts = torch.tensor([0, 1, 4, 4, 6], dtype=torch.int32)  # query lengths 1, 3, 0, 2
    lens = torch.tensor([9, 12, 5, 2], dtype=torch.int32)
    tables = torch.arange(8, dtype=torch.int32).reshape(4, 2)
    plan = cpu_ops.plan_attention(tables, starts, lens, 16)
    assert plan.row_seq.tolist() == [0, 1, 1, 1, 3, 3]
    assert plan.lens.tolist() == [9, 10, 11, 12, 1, 2]
    assert plan.block_tables.dtype == torch.int64 and torch.equal(plan.block_tables, tables.long())


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_prompt_and_prefix_continuation(dtype):
    run(make_batch([300, 40], [300, 257 + 40], block_size=16, dtype=dtype, seed=11))


@settings(max_examples=25, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(1, 120), st.integers(0, 40)), min_size=1, max_size=6),
       group=st.sampled_from([1, 2, 4, 6]), block_size=st.sampled_from([4, 16]), seed=st.integers(0, 1000))
def test_random_batches(seqs, group, block_size, seed):
    # (new queries, cached prefix) per sequence: decodes, whole prompts and continued chunks mixed.
    q_lens = [q for q, _ in seqs]
    run(make_batch(q_lens, [q + p for q, p in seqs], group=group, block_size=block_size, seed=seed,
                   num_kv_heads=2, head_dim=32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("length", [128, 129, 255, 257, 1000])
def test_a_lone_rows_long_context_is_split_into_chunks(dtype, block_size, length):
    # One row on one KV head is fewer work items than twice any thread count: past kChunkKeys (128)
    # keys its context is split and the chunks' softmax partials merged (one key past a boundary,
    # chunks of unequal block counts, many chunks).
    run(make_batch([1], [length], num_kv_heads=1, block_size=block_size, dtype=dtype, seed=length + block_size))


def test_bad_block_table_is_an_error_not_a_read():
    b = to_cpu_layout(make_batch([1, 1], [20, 20]))
    b.block_tables[1, 1] = 10_000
    with pytest.raises(RuntimeError, match="block id is outside the cache"):
        kernels.paged_attention(*b.args(), backend="cpu")


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_reference(dtype):
    gen = torch.Generator().manual_seed(1)
    nb, bs, h, d = 6, 16, 3, 40
    k_ref = torch.zeros(nb, bs, h, d, dtype=dtype)
    v_ref = torch.zeros_like(k_ref)
    k, v = kernels.allocate_kv_cache(nb, bs, h, d, dtype, "cpu", backend="cpu")
    n = 30
    qkv = torch.randn(n, 2 + 2 * h, d, generator=gen).to(dtype)  # key/value as strided views, as the model passes them
    key, value = qkv[:, 2:2 + h], qkv[:, 2 + h:]
    slots = torch.randperm(nb * bs, generator=gen)[:n]
    slots[::7] = -1  # padding
    reference.write_kv(key, value, k_ref, v_ref, slots)
    kernels.write_kv(key, value, k, v, slots, backend="cpu")
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    with pytest.raises(RuntimeError, match="slot outside the cache"):
        kernels.write_kv(key[:1], value[:1], k, v, torch.tensor([nb * bs]), backend="cpu")


def test_copy_blocks_on_cpu_layout():
    k, v = kernels.allocate_kv_cache(4, 16, 2, 8, torch.float32, "cpu", backend="cpu")
    k.copy_(torch.randn(k.shape))
    v.copy_(torch.randn(v.shape))
    want_k, want_v = k[1].clone(), v[1].clone()
    kernels.copy_blocks(k, v, torch.tensor([1]), torch.tensor([3]), backend="cpu")
    assert torch.equal(k[3], want_k) and torch.equal(v[3], want_v)


# ---- elementwise ops: within one rounding of the 16-bit result from the float64 definition ----

def close(got: torch.Tensor, want64: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 1.6e-2)}[dtype]
    torch.testing.assert_close(got.double(), want64, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [8, 64, 576, 1000])
def test_rms_norm(dtype, dim):
    gen = torch.Generator().manual_seed(dim)
    x, res = (torch.randn(37, dim, generator=gen).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(dim, generator=gen)).to(dtype)

    def norm64(t):
        t = t.double()
        return w.double() * t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)

    close(kernels.rms_norm(x, w, 1e-6, backend="cpu"), norm64(x), dtype)
    out, total = kernels.rms_norm(x, w, 1e-6, res, backend="cpu")
    assert torch.equal(total, x + res)  # the residual stream is added in the model's dtype, as the reference does
    close(out, norm64(x + res), dtype)
    ref_out, _ = reference.rms_norm(x, w, 1e-6, res)
    close(out, ref_out.double(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rotary_in_place_on_a_strided_view(dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    t, heads = 11, 5
    qkv = torch.randn(t, heads + 2, head_dim, generator=gen).to(dtype)
    x = qkv[:, :heads]  # strided rows, as the fused projection hands them over
    angle = torch.rand(t, 1, head_dim // 2, generator=gen, dtype=torch.float64) * 6
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    want = reference.apply_rotary(x, cos, sin)
    x1, x2 = x.double().chunk(2, dim=-1)
    c, s = cos.double(), sin.double()
    want64 = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    rest = qkv[:, heads:].clone()
    got = kernels.apply_rotary(x, cos, sin, backend="cpu")
    assert got.data_ptr() == x.data_ptr(), "rotated in place"
    assert torch.equal(qkv[:, heads:], rest), "the rest of the row is untouched"
    close(got, want64, dtype)
    close(got, want.double(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [8, 100, 1536])
def test_silu_and_mul(dtype, inter):
    gen = torch.Generator().manual_seed(inter)
    x = (3 * torch.randn(9, 2 * inter, generator=gen)).to(dtype)
    g, u = x.double().chunk(2, dim=-1)
    close(kernels.silu_and_mul(x, backend="cpu"), F.silu(g) * u, dtype)
    close(kernels.silu_and_mul(x, backend="cpu"), reference.silu_and_mul(x).double(), dtype)


def test_backend_resolution_on_cpu(monkeypatch):
    assert kernels.resolve_backend("auto", "cpu") == "cpu"
    assert kernels.resolve_backend("cpu", "cpu") == "cpu"
    with pytest.raises(ValueError, match="runs on the CPU device"):
        kernels.resolve_backend("cpu", "cuda")
    # A machine without a compiler: auto falls back to torch, an explicit "cpu" says what to do.
    monkeypatch.setattr(cpu_build._OPS, "module", None)
    monkeypatch.setattr(cpu_build._OPS, "error", OSError("no g++"))
    assert kernels.resolve_backend("auto", "cpu") == "torch"
    with pytest.raises(ValueError, match="install a C\\+\\+ compiler"):
        kernels.resolve_backend("cpu", "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_matches_float64(dtype):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(96, 40, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    packed = kernels.pack_linear_weight(w, backend="cpu")
    # oneDNN packs bf16 only where the CPU computes in it (AVX-512 or AVX-NE-CONVERT); elsewhere
    # the backend keeps the plain weight, and the results below must hold all the same.
    packs = dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert (packed is not None) == packs and kernels.pack_linear_weight(w, backend="torch") is None
    for x in (torch.randn(1, 40, generator=gen), torch.randn(64, 40, generator=gen),
              torch.randn(2, 5, 40, generator=gen)):
        x = x.to(dtype)
        want = F.linear(x.double(), w.double(), bias.double())
        got = kernels.linear(x, w, bias, packed)
        assert got.dtype == dtype and got.shape == want.shape
        tol = (1e-5, 1e-5) if dtype == torch.float32 else (3e-2, 1.6e-2)  # bf16: one output rounding
        torch.testing.assert_close(got.double(), want, atol=tol[0], rtol=tol[1])


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_16_bit_cache_under_float32_queries(cache_dtype):
    """kv_cache_dtype bfloat16 / float16 under a float32 model: the C++ ops round keys and values as
    they write them (as the reference's store does) and widen them as they read; the attention is
    the reference's on the same cache. A float32 cache under bfloat16 queries still takes the reference."""
    gen = torch.Generator().manual_seed(3)
    nb, bs, h, d = 6, 16, 2, 32
    k_ref, v_ref = (torch.zeros(nb, bs, h, d, dtype=cache_dtype) for _ in range(2))
    k, v = kernels.allocate_kv_cache(nb, bs, h, d, cache_dtype, "cpu", backend="cpu")
    key, value = torch.randn(2, 20, h, d, generator=gen)
    slots = torch.randperm(nb * bs, generator=gen)[:20]
    reference.write_kv(key, value, k_ref, v_ref, slots)
    kernels.write_kv(key, value, k, v, slots, backend="cpu")
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)

    b = make_batch([1, 5, 1], [30, 5, 17], dtype=torch.float32, seed=4)
    b.k_cache, b.v_cache = b.k_cache.to(cache_dtype), b.v_cache.to(cache_dtype)
    want = reference.paged_attention(*b.args())
    b = to_cpu_layout(b)
    got = kernels.paged_attention(*b.args(), backend="cpu")
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got[:b.num_tokens], want[:b.num_tokens])
    assert bool((got[b.num_tokens:] == 0).all())

    b = make_batch([1, 3], [9, 3], dtype=torch.bfloat16, seed=5)
    b.k_cache, b.v_cache = b.k_cache.float(), b.v_cache.float()
    want = reference.paged_attention(*b.args())
    got = kernels.paged_attention(*to_cpu_layout(b).args(), backend="cpu")
    torch.testing.assert_close(got[:b.num_tokens], want[:b.num_tokens])


def test_padded_step_sizes_are_few_and_close():
    # What bounds oneDNN's per-shape state: every step of 1..8192 tokens runs as one of 88 row
    # counts, never fewer rows than tokens and at most 1/8 more; small (decode) steps unpadded.
    from kernels.cpu_ops import padded_num_tokens

    sizes = [padded_num_tokens(n) for n in range(1, 8193)]
    assert len(set(sizes)) == 88
    assert all(n <= p <= n + n // 8 for n, p in enumerate(sizes, 1))
    assert sizes[:16] == list(range(1, 17)) and sizes == sorted(sizes)
    assert all(padded_num_tokens(p) == p for p in set(sizes))  # a padded size is its own size


@pytest.mark.parametrize("vocab", [31, 32, 1000, 49152])
def test_apply_token_bitmask_matches_reference(vocab):
    """Random masks (whole words allowed, whole words forbidden, mixed) over random logits: the
    C++ op and the reference set exactly the same tokens to -inf and leave the rest untouched."""
    gen = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    bitmask = torch.randint(-2**31, 2**31 - 1, (6, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1  # all allowed (an unconstrained row)
    bitmask[2] = 0  # nothing allowed
    bitmask[3, ::2] = -1
    logits = torch.randn(6, vocab, generator=gen)
    want, got = logits.clone(), logits.clone()
    reference.apply_token_bitmask(want, bitmask)
    kernels.get_backend("cpu").apply_token_bitmask(got, bitmask)
    assert torch.equal(got, want)
    assert torch.equal(got[1], logits[1]) and bool(torch.isinf(got[2]).all())
    bits = [(int(bitmask[0, t // 32]) >> (t % 32)) & 1 for t in range(vocab)]  # the definition, bit by bit
    assert [not torch.isinf(got[0, t]) for t in range(vocab)] == [bool(b) for b in bits]
