"""Compile the Triton kernels for Hopper (sm_90) and Ampere (sm_80) on a machine with no GPU.

Run as a script in a process without TRITON_INTERPRET (the test does that): the interpreter
accepts programs the GPU compiler rejects, so CPU-only machines also build the real binaries.
Each launch kernels/triton_ops.py and kernels/triton_moe.py make is recorded instead of run, then
compiled with the same arguments, constexprs and launch options. Prints one line per binary; exits non-zero on failure.
"""

from __future__ import annotations

import os
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import triton_moe, triton_ops

POINTER_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16",
                 torch.int32: "*i32", torch.int64: "*i64"}
# Shared memory one block may use (bytes), per compute capability.
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}


class Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.kernel, args, dict(kwargs)))


def source(kernel, args, kwargs):
    """ASTSource and options, specialised the way triton.jit would for these arguments."""
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(kernel.arg_names, args), **kwargs)
    signature, constexprs, attrs = {}, {}, {}
    for param in kernel.params:
        name, value = param.name, values[param.name]
        if param.is_constexpr or (isinstance(value, int) and value == 1):  # jit makes a 1 a constant
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = POINTER_TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(param.num,)] = [["tt.divisibility", 16]]
        elif isinstance(value, int):
            signature[name] = "i32" if abs(value) < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(param.num,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    return ASTSource(kernel, signature, constexprs, attrs), options


def record_launches():
    """The launches of a decode batch (with and without split-KV), a prefill, a KV store, and an
    MoE layer's two grouped GEMMs at decode and prefill tiles."""
    calls = []
    for name in ("paged_attention_kernel", "split_reduce_kernel", "write_kv_kernel"):
        setattr(triton_ops, name, Recorder(getattr(triton_ops, name), calls))
    triton_moe.grouped_gemm_kernel = Recorder(triton_moe.grouped_gemm_kernel, calls)
    triton_ops.INTERPRETED = True  # only recording: CPU tensors are fine

    def batch(num_seqs, q_len, head_dim, dtype=torch.bfloat16, heads=32, kv_heads=8, block_size=16, context=256):
        width = heads + 2 * kv_heads  # the query is a view of a fused qkv tensor, as in the model
        query = torch.empty(num_seqs * q_len, width, head_dim, dtype=dtype)[:, :heads]
        n = context // block_size
        cache = torch.empty(num_seqs * n, block_size, kv_heads, head_dim, dtype=dtype)
        table = torch.arange(num_seqs * n, dtype=torch.int32).view(num_seqs, n)
        qsl = torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32)
        return query, cache, cache.clone(), table, qsl, torch.full((num_seqs,), context, dtype=torch.int32), 0.1

    triton_ops.paged_attention(*batch(4, 1, 128), num_splits=1)
    triton_ops.paged_attention(*batch(2, 1, 128), num_splits=8)
    triton_ops.paged_attention(*batch(2, 256, 128), num_splits=1)
    triton_ops.paged_attention(*batch(2, 256, 80), num_splits=1)  # head dim padded to 128 lanes
    query, cache, _, _, _, _, _ = batch(8, 1, 128)
    key = torch.empty(8, 48, 128, dtype=torch.bfloat16)[:, 32:40]
    triton_ops.write_kv(key, key, cache, cache.clone(), torch.arange(8))
    experts, hidden, ffn, top_k = 8, 2048, 768, 2  # a Qwen3-MoE-sized expert, 8 of them held here
    w13 = torch.empty(experts, 2 * ffn, hidden, dtype=torch.bfloat16)
    w2 = torch.empty(experts, hidden, ffn, dtype=torch.bfloat16)
    for num_tokens in (64, 512):  # 16-row blocks, then 64-row blocks
        ids = torch.randint(0, 2 * experts, (num_tokens, top_k))
        x = torch.empty(num_tokens, hidden, dtype=torch.bfloat16)
        triton_moe.fused_moe(x, torch.rand(num_tokens, top_k), ids, w13, w2, expert_offset=experts // 2)
    return calls


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on"), "run without the interpreter"
    failures = 0
    for kernel, args, kwargs in record_launches():
        for capability in (90, 80):
            src, options = source(kernel, args, dict(kwargs))
            consts = {k: v for k, v in kwargs.items() if k.isupper()}
            label = f"sm_{capability} {kernel.__name__} {consts} {options}"
            try:
                compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)
                shared = compiled.metadata.shared
                assert shared <= SHARED_LIMIT[capability], f"needs {shared} bytes of shared memory"
                print(f"ok   {label}: {shared} bytes shared", flush=True)
            except Exception as e:  # report every failure, not just the first
                failures += 1
                print(f"FAIL {label}: {type(e).__name__}: {e}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
