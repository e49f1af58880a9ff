"""Builders for paged-attention test batches and a float64 naive attention to check against.

A batch lays each sequence's context over shuffled physical blocks, pads block tables with 0 (a
real block that belongs to someone else) as the engine does, and fills every cache slot outside a
sequence's context with NaN: a kernel that reads a slot it should not turns its output into NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bfloat16 too under the interpreter: conftest.py patches it to compute bf16 as a GPU does.
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (atol, rtol) per dtype: outputs are averages of unit-normal values, so at most about 5 in size,
# and the 16-bit ones differ from the float64 truth by up to a rounding of P and of the output.
TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
NAN = float("nan")


@dataclass
class Batch:
    query: torch.Tensor  # [num_tokens (+ padding rows), num_heads, head_dim]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    scale: float
    num_tokens: int  # real query rows; rows past it are padding no op may write

    def args(self):
        return (self.query, self.k_cache, self.v_cache, self.block_tables, self.query_start_loc,
                self.seq_lens, self.scale)


def make_batch(q_lens: list[int], seq_lens: list[int], *, num_kv_heads: int = 2, group: int = 4,
               head_dim: int = 64, block_size: int = 16, dtype: torch.dtype = torch.float32,
               index_dtype: torch.dtype = torch.int32, seed: int = 0, pad_rows: int = 0,
               strided_query: bool = False) -> Batch:
    """Sequence i brings q_lens[i] new queries and has seq_lens[i] keys in cache after this step."""
    assert all(0 <= q <= s for q, s in zip(q_lens, seq_lens))
    gen = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    n_blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(n_blocks) + 2  # two spare blocks no sequence owns
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, NAN, dtype=dtype)
    v_cache = torch.full(shape, NAN, dtype=dtype)
    table = torch.zeros(len(seq_lens), max(n_blocks, default=0) + 1, dtype=index_dtype)  # +1: a padding column
    owners = torch.randperm(num_blocks, generator=gen).tolist()
    for i, (s, n) in enumerate(zip(seq_lens, n_blocks)):
        blocks, owners = owners[:n], owners[n:]
        table[i, :n] = torch.tensor(blocks, dtype=index_dtype)
        for pos in range(s):
            b, off = blocks[pos // block_size], pos % block_size
            k_cache[b, off] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
            v_cache[b, off] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)

    num_tokens = sum(q_lens)
    rows = num_tokens + pad_rows
    # A strided query is a view of a fused qkv projection: its token stride exceeds heads * dim.
    width = num_heads + 2 * num_kv_heads if strided_query else num_heads
    qkv = torch.randn(rows, width, head_dim, generator=gen).to(dtype)
    query = qkv[:, :num_heads]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=index_dtype)
    lens = torch.tensor(seq_lens, dtype=index_dtype)
    to = dict(device=DEVICE)
    return Batch(query.to(**to), k_cache.to(**to), v_cache.to(**to), table.to(**to), qsl.to(**to),
                 lens.to(**to), 1.0 / math.sqrt(head_dim), num_tokens)


def naive_attention(b: Batch, sliding_window=None, logits_soft_cap=None, sinks=None) -> torch.Tensor:
    """Float64, one query row at a time, straight from the definition in kernels/reference.py: with a
    window a query at position p sees keys after p - window, a cap bends scores to cap * tanh(s / cap),
    and a sink per head joins each row's softmax denominator."""
    block_size, num_kv_heads = b.k_cache.shape[1], b.k_cache.shape[2]
    group = b.query.shape[1] // num_kv_heads
    out = torch.full(b.query.shape, NAN, dtype=torch.float64)
    qsl, lens, table = b.query_start_loc.tolist(), b.seq_lens.tolist(), b.block_tables.cpu()
    k_cache, v_cache, query = (t.cpu().double() for t in (b.k_cache, b.v_cache, b.query))
    for i, seq_len in enumerate(lens):
        blocks = table[i, :-(-seq_len // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:seq_len]  # [seq_len, num_kv_heads, head_dim]
        v = v_cache[blocks].flatten(0, 1)[:seq_len]
        q_len = qsl[i + 1] - qsl[i]
        for j in range(q_len):
            pos = seq_len - q_len + j
            first = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(query.shape[1]):
                scores = (k[first: pos + 1, h // group] @ query[qsl[i] + j, h]) * b.scale
                if logits_soft_cap is not None:
                    scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
                sink = None if sinks is None else float(sinks[h].double())
                top = scores.max() if sink is None else max(scores.max(), torch.tensor(sink, dtype=torch.float64))
                weights = (scores - top).exp()
                denominator = weights.sum() + (0.0 if sink is None else float(torch.exp(sink - top)))
                out[qsl[i] + j, h] = weights @ v[first: pos + 1, h // group] / denominator
    return out


def check_attention(out: torch.Tensor, b: Batch, reference_out: torch.Tensor) -> None:
    """Real rows match the float64 definition and the reference op; padding rows stay poisoned."""
    expect = naive_attention(b)
    atol, rtol = TOLERANCE[b.query.dtype]
    real = slice(0, b.num_tokens)
    got = out[real].cpu().double()
    assert not got.isnan().any(), "an output row was left unwritten (still NaN)"
    torch.testing.assert_close(got, expect[real], atol=atol, rtol=rtol)
    torch.testing.assert_close(got, reference_out[real].cpu().double(), atol=atol, rtol=rtol)
    assert out[b.num_tokens:].isnan().all(), "a padding row past the last sequence was written"


def to_cpu_layout(b):
    """The batch with its caches copied into cpu-backend caches (logical contents unchanged)."""
    nb, bs, h, d = b.k_cache.shape
    k, v = kernels.allocate_kv_cache(nb, bs, h, d, b.k_cache.dtype, "cpu", backend="cpu")
    k.copy_(b.k_cache)
    v.copy_(b.v_cache)
    b.k_cache, b.v_cache = k, v
    return b
