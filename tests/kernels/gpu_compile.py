"""Compile the Triton kernels for Hopper (sm_90) and Ampere (sm_80) on a machine with no GPU.

Run as a script in a process without TRITON_INTERPRET (the test does that): the interpreter
accepts programs the GPU compiler rejects, so CPU-only machines also build the real binaries.
Each launch kernels/triton_ops.py, triton_moe.py, triton_quant.py, triton_quant_packed.py and
triton_lora.py make is recorded instead of run, then compiled with the same arguments, constexprs,
specialisations and launch options. The start-up warm-up (triton_ops.warmup) is recorded too;
`--all-warmup-variants` records every variant it compiles on a GPU instead (slow). Prints one line
per binary; exits non-zero on failure.
"""

from __future__ import annotations

import os
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import triton_lora, triton_moe, triton_ops, triton_quant, triton_quant_packed

POINTER_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16",
                 torch.int32: "*i32", torch.int64: "*i64", torch.uint8: "*u8"}
if getattr(torch, "float8_e4m3fn", None) is not None:
    POINTER_TYPES[torch.float8_e4m3fn] = "*fp8e4nv"
# Shared memory one block may use (bytes), per compute capability.
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}


class Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the call, with the compute
    capabilities to build it for."""

    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls
        self.capabilities = (90, 80)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.kernel, args, dict(kwargs), self.capabilities))


def source(kernel, args, kwargs):
    """ASTSource and options, specialised the way triton.jit would for these arguments."""
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(kernel.arg_names, args), **kwargs)
    signature, constexprs, attrs = {}, {}, {}
    for param in kernel.params:
        name, value = param.name, values[param.name]
        specialize = not param.do_not_specialize
        if param.is_constexpr or (specialize and isinstance(value, int) and value == 1):  # jit makes a 1 a constant
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = POINTER_TYPES[value.dtype]
            if value.data_ptr() % 16 == 0 and not param.do_not_specialize_on_alignment:
                attrs[(param.num,)] = [["tt.divisibility", 16]]
        elif isinstance(value, int):
            signature[name] = "i32" if abs(value) < 2**31 else "i64"
            if specialize and value % 16 == 0:
                attrs[(param.num,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    return ASTSource(kernel, signature, constexprs, attrs), options


def job_key(kernel, args, kwargs):
    """What triton.jit caches a binary by: the same key twice is one compile."""
    src, options = source(kernel, args, dict(kwargs))
    return src.hash(), str(sorted(options.items()))


def record_launches(all_warmup_variants: bool = False, warmup_only: bool = False):
    """The launches of a decode batch (with and without split-KV), a prefill, a KV store, an MoE
    layer's two grouped GEMMs at decode and prefill tiles and its SiLU-and-mul, the weight-only
    matmul on each block format (GGUF's and fp8's; decode with split-K, int8's and int4's formats
    at the prefill tiles too), the LoRA shrink and expand, and the start-up warm-up of a
    Llama-3.2-1B shape at a short max_model_len (no split counts; the fused norm, rotary + KV store
    and SiLU-and-mul), also with an fp8 cache (Hopper only: Ampere has no e4m3 conversions,
    kernels.fp8_kv_cache_error). With all_warmup_variants, instead the warm-ups of the 1B shape at
    8k context (every tile and split count on an H100's 132 SMs) and of a Qwen3 shape (q/k norms
    on head-strided rows): what a GPU compiles at start-up, many more binaries."""
    calls = []
    names = ("paged_attention_kernel", "split_reduce_kernel", "write_kv_kernel", "rms_norm_kernel",
             "rotary_write_kv_kernel", "silu_and_mul_kernel")
    recorders = {name: Recorder(getattr(triton_ops, name), calls) for name in names}
    for name, recorder in recorders.items():
        setattr(triton_ops, name, recorder)
    triton_moe.grouped_gemm_kernel = Recorder(triton_moe.grouped_gemm_kernel, calls)
    for name in ("quant_matmul_kernel", "sum_splits_kernel"):
        setattr(triton_quant, name, Recorder(getattr(triton_quant, name), calls))
    for name in ("gemv_kernel", "dot_kernel"):
        setattr(triton_quant_packed, name, Recorder(getattr(triton_quant_packed, name), calls))
    for name in ("lora_shrink_kernel", "lora_shrink_tiled_kernel", "lora_expand_kernel", "lora_expand_tiled_kernel"):
        setattr(triton_lora, name, Recorder(getattr(triton_lora, name), calls))
    triton_ops.INTERPRETED = True  # only recording: CPU tensors are fine
    triton_ops._num_sms = lambda device: 132  # an H100's: the warm-up enumerates split counts by it
    llama_1b = dict(num_heads=32, num_kv_heads=8, head_dim=64, block_size=16, max_model_len=8192,
                    dtype=torch.bfloat16, device="cpu", hidden_size=2048, intermediate_sizes=(8192,))
    if warmup_only:  # the shape check_steps_after_warmup steps through
        triton_ops.warmup(**dict(llama_1b, max_model_len=2048))
        return calls
    if all_warmup_variants:
        triton_ops.warmup(**llama_1b)
        triton_ops.warmup(num_heads=16, num_kv_heads=8, head_dim=128, block_size=16, max_model_len=1024,
                          dtype=torch.bfloat16, device="cpu", hidden_size=1024, qk_norm=True)  # Qwen3-0.6B
        return calls

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
    for fmt, (_, _, block, block_bytes) in triton_quant.FORMATS.items():  # a 2048 x 2048 quantized linear
        blocks = torch.empty(2048, 2048 // block * block_bytes, dtype=torch.uint8)
        # decode (split-K partials on 132 SMs); int8's and int4's formats at the prefill tiles too
        for num_tokens in (1, 40, 512) if fmt in ("Q8_0", "Q4_1") else (1,):
            triton_quant.quant_linear(torch.empty(num_tokens, 2048, dtype=torch.bfloat16), blocks, fmt)
        if fmt in triton_quant_packed.FORMATS:  # the triton backend's repacked copy: each kernel and row tile
            packed = triton_quant_packed.pack(torch.zeros_like(blocks), fmt)
            for num_tokens in (1, 2, 3, 16, 40, 512):
                triton_quant_packed.packed_linear(torch.empty(num_tokens, 2048, dtype=torch.bfloat16), packed)
            # one row on part-filled tiles (the masked loop), split and whole
            odd = triton_quant_packed.pack(torch.zeros_like(blocks[:45]), fmt)
            triton_quant_packed.packed_linear(torch.empty(1, 2048, dtype=torch.bfloat16), odd)
            triton_quant_packed.packed_linear(torch.empty(1, 2048, dtype=torch.bfloat16), odd, num_splits=1)
    # A 1B model's fused q/k/v projection under rank-16 adapters (3 unequal slices) at decode and
    # prefill sizes (the tiled kernels), and an odd rank on a plain one.
    for tokens, rank, out_slices in ((8, 16, (2048, 512, 512)), (512, 16, (2048, 512, 512)), (8, 7, (2048,))):
        slots = torch.zeros(tokens, dtype=torch.int32)
        x = torch.empty(tokens, 2048, dtype=torch.bfloat16)
        buf = triton_lora.lora_shrink(x, torch.empty(4, len(out_slices) * rank, 2048, dtype=torch.bfloat16), slots)
        lora_b = torch.empty(4, sum(out_slices), rank, dtype=torch.bfloat16)
        y = torch.empty(tokens, sum(out_slices), dtype=torch.bfloat16)
        triton_lora.lora_expand(y, buf, lora_b, slots, out_slices)
    triton_ops.warmup(**dict(llama_1b, max_model_len=256))
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is not None:
        for recorder in recorders.values():
            recorder.capabilities = (90,)
        triton_ops.warmup(**dict(llama_1b, max_model_len=256, kv_cache_dtype=fp8))
    return calls


def check_steps_after_warmup() -> int:
    """No step of a served model needs a binary the start-up warm-up did not build: record the
    warm-up's launches, then the launches of steps of many batch shapes (1 to 65 sequences, decodes,
    prefill chunks, block tables 1 to 128 blocks wide, metadata at 8-byte offsets into a staging
    buffer as engine/runner/step_inputs.py lays it out), laid out as the model lays out its tensors, and
    compare what triton.jit would cache each by. Prints every launch that would compile anew.
    Quantized linears likewise: the warm-ups' launches for a 1B model's int4 / int8 layer shapes
    (repacked: triton_quant_packed) and a Q6_K LM head (blocks: triton_quant), then those layers at
    1 to 2048 rows."""
    calls = record_launches(warmup_only=True)
    quant_layers, packed_layers = [], []  # GGUF blocks (Q6_K), repacked copies (the rest), as the runner holds them
    for fmt, n, k in (("Q4_1", 3072, 2048), ("Q4_1", 2048, 2048), ("Q4_1", 16384, 2048), ("Q8_0", 2048, 8192),
                      ("Q6_K", 128256, 2048)):
        _, _, block, block_bytes = triton_quant.FORMATS[fmt]
        blocks = torch.zeros(n, k // block * block_bytes, dtype=torch.uint8)
        if fmt in triton_quant_packed.FORMATS:
            packed_layers.append((triton_quant_packed.pack(blocks, fmt), None))
        else:
            quant_layers.append((fmt, blocks, None))
    triton_quant.warmup(quant_layers, torch.bfloat16, "cpu", max_num_tokens=2048)
    triton_quant_packed.warmup(packed_layers, torch.bfloat16, "cpu", max_num_tokens=2048)
    warm = {job_key(kernel, args, kwargs) for kernel, args, kwargs, _ in calls}
    heads, kv_heads, head_dim, block_size, hidden, inter = 32, 8, 64, 16, 2048, 8192
    dtype = torch.bfloat16
    cache = torch.empty(64, block_size, kv_heads, head_dim, dtype=dtype)
    weight = torch.empty(hidden, dtype=dtype)
    staging = torch.empty(4096, dtype=torch.uint8)
    del calls[:]
    # (sequences, queries each, block-table width <= max_model_len / block_size = 128): split counts
    # 1 to 8 on 132 SMs, decode and prefill tiles.
    for num_seqs, q_len, width in [(1, 1, 1), (1, 1, 3), (1, 1, 128), (2, 1, 16), (3, 1, 17), (16, 1, 40),
                                   (17, 1, 128), (65, 1, 9), (1, 37, 4), (2, 64, 128), (5, 16, 7), (1, 200, 13)]:
        num_tokens = num_seqs * q_len
        qkv = torch.empty(num_tokens, heads + 2 * kv_heads, head_dim, dtype=dtype)
        x = torch.empty(num_tokens, hidden, dtype=dtype)
        triton_ops.rms_norm(x, weight, 1e-6, x)
        cos = torch.empty(num_tokens, head_dim // 2, dtype=dtype).unsqueeze(1)
        slots = staging[8:8 + 8 * num_tokens].view(torch.int64)  # 8-byte aligned, not 16
        qk = triton_ops.rotary_write_kv(qkv[:, :heads + kv_heads], qkv[:, heads + kv_heads:], cos, cos, cache,
                                        cache, slots)
        table = torch.zeros(num_seqs, width, dtype=torch.int32)
        meta = staging[2408:2408 + 4 * (2 * num_seqs + 1)].view(torch.int32)  # 8-byte aligned, not 16
        triton_ops.paged_attention(qk[:, :heads], cache, cache, table, meta[:num_seqs + 1], meta[num_seqs + 1:],
                                   0.125)
        triton_ops.silu_and_mul(torch.empty(num_tokens, 2 * inter, dtype=dtype))
    for num_tokens in (1, 2, 5, 16, 17, 40, 64, 65, 100, 129, 300, 777, 1500, 2048):
        for fmt, blocks, _ in quant_layers:
            k = blocks.shape[1] // triton_quant.FORMATS[fmt][3] * triton_quant.FORMATS[fmt][2]
            triton_quant.quant_linear(torch.empty(num_tokens, k, dtype=dtype), blocks, fmt)
        for packed, _ in packed_layers:
            triton_quant_packed.packed_linear(torch.empty(num_tokens, packed.shape[1], dtype=dtype), packed)
    new = 0
    for kernel, args, kwargs, _ in calls:
        if job_key(kernel, args, kwargs) not in warm:
            new += 1
            consts = {k: v for k, v in kwargs.items() if k.isupper()}
            print(f"NEW  {kernel.__name__} {consts}: a step of this shape would compile after the warm-up", flush=True)
    print(f"{len(calls)} step launches, {new} needing a binary the warm-up did not build", flush=True)
    return 1 if new or not calls else 0


def main(argv: list[str]) -> int:
    assert os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on"), "run without the interpreter"
    if "--check-steps-after-warmup" in argv:
        return check_steps_after_warmup()
    failures = 0
    jobs = {}
    for kernel, args, kwargs, capabilities in record_launches("--all-warmup-variants" in argv):
        jobs.setdefault(job_key(kernel, args, kwargs), (kernel, args, kwargs, capabilities))
    for kernel, args, kwargs, capabilities in jobs.values():
        for capability in capabilities:
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
    sys.exit(main(sys.argv[1:]))
