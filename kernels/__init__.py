"""The attention, KV-cache, fused elementwise, mixture-of-experts and multi-LoRA ops the engine
calls; the one place a backend is chosen.

Backends:
  torch   kernels/reference.py: pure torch, the test oracle, and the fallback on any device.
  cpu     kernels/cpu_ops.py: C++ kernels (kernels/cpu_ops.cpp, compiled on first use) for CPU
          paged attention, the KV store, the fused norm / rotary / SwiGLU and the fused MoE
          layer, and oneDNN matmuls on prepacked weights; the LoRA shrink and expand in
          kernels/cpu_lora.py (their own library, built on the first LoRA call). The default on
          CPU when a C++ compiler is there.
  triton  kernels/triton_*.py: the CUDA path (the MoE layer as a grouped GEMM, triton_moe.py;
          the LoRA shrink and expand, triton_lora.py).
          On CPU tensors it runs only under Triton's interpreter (TRITON_INTERPRET=1 set before
          the kernels are imported), for tests.

The engine chooses once: resolve_backend() maps its setting to a backend name at start-up,
get_backend() gives that name's one Backend object, and every op is then a plain call on it
(`backend.rms_norm(...)`), with no dispatch per call. The module-level functions below take a
backend name instead, for tests and benches. Triton and the C++ build are reached lazily, only
once their backend is resolved or used, so `import kernels` stays light and works where either
is missing.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import reference

logger = logging.getLogger(__name__)

BACKENDS = ("torch", "cpu", "triton")
# What triton itself reads as "on" for its boolean environment variables.
_TRUE = ("1", "true", "on")


def _triton_import_error() -> ImportError | None:
    try:
        importlib.import_module("triton")
    except ImportError as e:
        return e
    return None


def _cpu_error() -> Exception | None:
    from kernels import cpu_build

    return cpu_build.available()


def resolve_backend(name: str, device_type: str) -> str:
    """Map an `attention_backend` setting ("auto" | "torch" | "cpu" | "triton") to a usable
    backend, or raise ValueError saying what to change."""
    if name not in ("auto",) + BACKENDS:
        raise ValueError(f"attention_backend {name!r} is unknown; use one of {('auto',) + BACKENDS}")
    if name == "torch":
        return "torch"
    if name == "cpu" or (name == "auto" and device_type == "cpu"):
        if device_type != "cpu":
            raise ValueError(f"attention_backend 'cpu' runs on the CPU device, not {device_type!r}; "
                             "use attention_backend='auto'")
        error = _cpu_error()
        if error is None:
            return "cpu"
        if name == "cpu":
            raise ValueError(f"attention_backend 'cpu' needs its C++ kernels, which failed to build ({error}); "
                             "install a C++ compiler (g++) or use attention_backend='torch'")
        logger.warning("CPU kernels unavailable (%s); using the slower pure-torch backend", error)
        return "torch"
    if name == "auto" and device_type != "cuda":
        return "torch"
    error = _triton_import_error()
    if name == "auto":
        return "torch" if error is not None else "triton"
    if error is not None:
        raise ValueError(f"attention_backend 'triton' needs the triton package, which failed to import "
                         f"({error}); install triton or use attention_backend='torch'")
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET", "").lower() not in _TRUE:
        raise ValueError(f"attention_backend 'triton' on {device_type!r} runs only under Triton's interpreter: "
                         "set TRITON_INTERPRET=1 in the environment before starting (slow; for tests), "
                         "or use attention_backend='torch'")
    return "triton"


def fp8_kv_cache_error(backend: str, device: torch.device) -> str | None:
    """Why `backend` on `device` cannot keep an fp8 (e4m3) KV cache, or None when it can."""
    if getattr(torch, "float8_e4m3fn", None) is None:
        return f"needs torch's float8_e4m3fn dtype, which this torch ({torch.__version__}) lacks (torch >= 2.1 has it)"
    if backend == "triton" and device.type == "cuda":
        # Triton converts to and from e4m3 (its float8e4nv) only from Ada / Hopper on.
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            return (f"on the triton backend needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                    f"this one is {capability[0]}.{capability[1]}")
    return None


@dataclass(frozen=True)
class Backend:
    """One backend's ops, chosen once at start-up (`get_backend(resolve_backend(...))`) and called
    directly: `backend.rms_norm(...)` runs that backend's kernel with no per-call dispatch. Every
    backend has the same signatures (the module-level functions below document each op)."""

    name: str
    write_kv: Callable  # (key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None
    # (query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, plan=None, k_scale=1.0, v_scale=1.0,
    #  sliding_window=None, logits_soft_cap=None, sinks=None)
    paged_attention: Callable
    plan_attention: Callable  # (block_tables, query_start_loc, seq_lens, block_size) -> plan or None
    allocate_kv_cache: Callable  # (num_blocks, block_size, num_kv_heads, head_dim, dtype, device) -> (k, v)
    copy_blocks: Callable  # (k_cache, v_cache, src, dst) -> None
    rms_norm: Callable  # (x, weight, eps, residual=None) -> y, or (y, x + residual)
    apply_rotary: Callable  # (x, cos, sin) -> rotated x (may be x itself, rotated in place)
    silu_and_mul: Callable  # (x) -> silu(gate) * up
    pack_linear_weight: Callable  # (weight) -> packed copy or None
    linear: Callable  # (x, weight, bias=None, packed=None) -> x @ weight.T + bias
    padded_num_tokens: Callable  # (n) -> rows to run a step of n tokens as; the rows past n are padding
    apply_token_bitmask: Callable  # (logits [B, V] float32, bitmask [B, ceil(V/32)] int32) -> None, in place
    select_experts: Callable  # (router_logits [T, E], top_k, renormalize) -> (weights [T, k] float32, ids [T, k] int64)
    pack_moe_weights: Callable  # (w13, w2) -> packed expert weights or None
    fused_moe: Callable  # (x, topk_weights, topk_ids, w13, w2, expert_offset=0, packed=None) -> [T, H]
    # (qk, value, cos, sin, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> qk rotated;
    # qk's last value.shape[1] heads (the keys), rotated, and value stored at their slots
    rotary_write_kv: Callable
    argmax: Callable  # (logits [B, V]) -> int64 [B]: each row's first maximum (NaN first), greedy sampling
    lora_shrink: Callable  # (x [T, K], lora_a [S, N, K], token_slots [T] int32) -> buf [T, N] float32
    lora_expand: Callable  # (y [T, M], buf [T, N], lora_b [S, M, R], token_slots, out_slices) -> None, in place


def _plain_linear(x, weight, bias=None, packed=None):
    return F.linear(x, weight, bias)


def _no_packing(weight):
    return None


def _no_padding(num_tokens):
    return num_tokens


def _no_moe_packing(w13, w2):
    return None


def _rotary_then_write_kv(apply_rotary: Callable, write_kv: Callable) -> Callable:
    """rotary_write_kv from a backend's own two ops, called as the attention layer called them."""

    def rotary_write_kv(qk, value, cos, sin, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
        qk = apply_rotary(qk, cos, sin)
        write_kv(qk[:, qk.shape[1] - value.shape[1]:], value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return qk

    return rotary_write_kv


def _torch_backend() -> Backend:
    def allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return reference.allocate_kv_cache(*shape, dtype, device), reference.allocate_kv_cache(*shape, dtype, device)

    r = reference
    return Backend("torch", r.write_kv, r.paged_attention, r.plan_attention, allocate_kv_cache, r.copy_blocks,
                   r.rms_norm, r.apply_rotary, r.silu_and_mul, _no_packing, _plain_linear, _no_padding,
                   r.apply_token_bitmask, r.select_experts, _no_moe_packing, r.fused_moe,
                   rotary_write_kv=_rotary_then_write_kv(r.apply_rotary, r.write_kv), argmax=r.argmax,
                   lora_shrink=r.lora_shrink, lora_expand=r.lora_expand)


def _cpu_backend() -> Backend:
    from kernels import cpu_lora  # its own library, built on the first LoRA call
    from kernels import cpu_ops as c  # the C++ build itself waits for the first kernel call

    def linear(x, weight, bias=None, packed=None):
        return c.linear(x, packed, bias) if packed is not None else F.linear(x, weight, bias)

    return Backend("cpu", c.write_kv, c.paged_attention, c.plan_attention, c.allocate_kv_cache, c.copy_blocks,
                   c.rms_norm, c.apply_rotary, c.silu_and_mul, c.pack_linear_weight, linear, c.padded_num_tokens,
                   c.apply_token_bitmask, c.select_experts, c.pack_moe_weights, c.fused_moe,
                   rotary_write_kv=_rotary_then_write_kv(c.apply_rotary, c.write_kv), argmax=c.argmax,
                   lora_shrink=cpu_lora.lora_shrink, lora_expand=cpu_lora.lora_expand)


def _triton_backend() -> Backend:
    """Attention, the KV store, the MoE grouped GEMMs, the LoRA shrink and expand and the fused
    elementwise ops (residual-add + RMSNorm, rotary + KV store, SiLU-and-mul: one launch each,
    kernels/triton_fused.py) in Triton; routing and the token bitmask stay torch."""
    from kernels import triton_lora, triton_moe
    from kernels import triton_ops as t

    def paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, plan=None,
                        k_scale=1.0, v_scale=1.0, sliding_window=None, logits_soft_cap=None, sinks=None):
        return t.paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                 k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window,
                                 logits_soft_cap=logits_soft_cap, sinks=sinks)

    def plan_attention(block_tables, query_start_loc, seq_lens, block_size):
        return None  # the kernels read the block tables themselves

    def allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return torch.zeros(*shape, dtype=dtype, device=device), torch.zeros(*shape, dtype=dtype, device=device)

    r = reference
    return Backend("triton", t.write_kv, paged_attention, plan_attention, allocate_kv_cache, t.copy_blocks,
                   t.rms_norm, t.apply_rotary, t.silu_and_mul, _no_packing, _plain_linear, _no_padding,
                   r.apply_token_bitmask, r.select_experts, _no_moe_packing, triton_moe.fused_moe,
                   rotary_write_kv=t.rotary_write_kv, argmax=r.chunked_argmax,
                   lora_shrink=triton_lora.lora_shrink, lora_expand=triton_lora.lora_expand)


_BUILDERS = {"torch": _torch_backend, "cpu": _cpu_backend, "triton": _triton_backend}


@functools.cache
def _backend(name: str) -> Backend:
    return _BUILDERS[name]()


def get_backend(name: str) -> Backend:
    """The one Backend object of `name` (a name resolve_backend() returned); triton_ops and
    cpu_ops are imported on the first call for their backend."""
    if name not in _BUILDERS:
        raise ValueError(f"backend {name!r} is not one of {BACKENDS}; pass what resolve_backend() returned")
    return _backend(name)


# ---- the ops by backend name: thin wrappers over get_backend(name), for tests and benches -------------


def write_kv(key, value, k_cache, v_cache, slot_mapping, backend: str = "torch", k_scale: float = 1.0,
             v_scale: float = 1.0) -> None:
    """Store each new token's key and value at its slot in the paged cache; slot -1 = padding.
    An fp8 cache stores key / k_scale and value / v_scale, saturated to e4m3 (reference.quantize_kv)."""
    get_backend(backend).write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                    backend: str = "torch", plan=None, k_scale: float = 1.0, v_scale: float = 1.0,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None, sinks=None):
    """Causal attention of each sequence's new queries over its cached keys and values.
    `plan`: plan_attention's per-step batch layout, shared by all layers (ignored where it is None).
    An fp8 cache is read as e4m3 * k_scale / v_scale, converted inside the kernel.
    sliding_window: a query at position p sees keys at positions > p - window; logits_soft_cap:
    scores become cap * tanh(score / cap); sinks: [num_heads] float32 logits, one per query head,
    that join each row's softmax denominator (kernels/reference.py defines all three)."""
    return get_backend(backend).paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                                scale, plan=plan, k_scale=k_scale, v_scale=v_scale,
                                                sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                                sinks=sinks)


def plan_attention(block_tables, query_start_loc, seq_lens, block_size: int, backend: str = "torch"):
    """Per-step work shared by every layer's attention call; None where the backend needs none."""
    return get_backend(backend).plan_attention(block_tables, query_start_loc, seq_lens, block_size)


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, device,
                      backend: str = "torch"):
    """(k_cache, v_cache), zeroed, each of logical shape [num_blocks, block_size, num_kv_heads,
    head_dim]. Their memory layout is the backend's choice: contiguous for Triton, head-major
    underneath for torch, keys transposed within blocks for cpu."""
    return get_backend(backend).allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)


def copy_blocks(k_cache, v_cache, src, dst, backend: str = "torch") -> None:
    """Copy whole cache blocks src[i] -> dst[i] (copy-on-write of a shared partial block)."""
    get_backend(backend).copy_blocks(k_cache, v_cache, src, dst)


def rms_norm(x, weight, eps: float, residual=None, backend: str = "torch"):
    """Without residual: weight * norm(x). With residual: (weight * norm(x + residual), x + residual)."""
    return get_backend(backend).rms_norm(x, weight, eps, residual)


def apply_rotary(x, cos, sin, backend: str = "torch"):
    """Rotary embedding of x [tokens, heads, head_dim] by cos/sin [tokens, 1, head_dim / 2];
    may rotate x in place (cpu backend): use the returned tensor."""
    return get_backend(backend).apply_rotary(x, cos, sin)


def rotary_write_kv(qk, value, cos, sin, k_cache, v_cache, slot_mapping, backend: str = "torch",
                    k_scale: float = 1.0, v_scale: float = 1.0):
    """apply_rotary then write_kv, fused where the backend can: qk [tokens, heads + kv_heads,
    head_dim] holds the queries then the keys; both are rotated (maybe in place: use the returned
    tensor) and the rotated keys and `value` [tokens, kv_heads, head_dim] stored at their slots."""
    return get_backend(backend).rotary_write_kv(qk, value, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def silu_and_mul(x, backend: str = "torch"):
    """[tokens, 2 * inter] = [gate | up] -> silu(gate) * up."""
    return get_backend(backend).silu_and_mul(x)


def pack_linear_weight(weight, backend: str = "torch"):
    """A copy of a linear weight in the layout the backend's matmul wants (cpu: oneDNN's blocked
    layout), or None where the plain weight is best. Hand it back to linear()."""
    return get_backend(backend).pack_linear_weight(weight)


def linear(x, weight, bias=None, packed=None):
    """x @ weight.T + bias, through `packed` when pack_linear_weight made one (only the cpu
    backend packs, so a packed weight is the cpu backend's)."""
    return get_backend("cpu" if packed is not None else "torch").linear(x, weight, bias, packed)


def select_experts(router_logits, top_k: int, renormalize: bool, backend: str = "torch"):
    """Each token's top_k experts by softmax of its router logits: (weights [T, top_k] float32,
    ids [T, top_k] int64, global expert ids), the weights renormalised to sum to 1 when asked."""
    return get_backend(backend).select_experts(router_logits, top_k, renormalize)


def pack_moe_weights(w13, w2, backend: str = "torch"):
    """One layer's stacked expert weights (w13 [E, 2F, H], w2 [E, H, F]) in the layout the
    backend's fused_moe wants (cpu: oneDNN's blocked layout per expert), or None where the plain
    stacked weights are best. When it returns one, fused_moe needs only it: the caller frees
    w13 and w2 (empty tensors) and keeps one resident copy of the experts."""
    return get_backend(backend).pack_moe_weights(w13, w2)


def fused_moe(x, topk_weights, topk_ids, w13, w2, expert_offset: int = 0, packed=None, backend: str = "torch"):
    """[T, H] in x.dtype: for each token, the sum over its chosen experts held here (expert_offset
    <= id < expert_offset + E) of weight * w2[e] @ silu_and_mul(w13[e] @ x); experts held on
    other ranks add nothing (the caller all-reduces). `packed`: pack_moe_weights' result, read
    instead of w13 / w2, which may then be empty."""
    return get_backend(backend).fused_moe(x, topk_weights, topk_ids, w13, w2, expert_offset, packed)


def lora_shrink(x, lora_a, token_slots, backend: str = "torch"):
    """Multi-LoRA's first half (Punica's shrink): buf [T, N] float32 with buf[t] = x[t] @
    lora_a[token_slots[t]].T summed in float32, 0 where token_slots[t] is -1 (a token of the base
    model). x [T, K] float32 / bfloat16 / float16 with contiguous rows (a row-strided view is fine),
    lora_a [S, N, K] of x's dtype, one adapter per slot; a fused projection stacks one A per part
    (N = parts * R). token_slots [T] int32."""
    return get_backend(backend).lora_shrink(x, lora_a, token_slots)


def lora_expand(y, buf, lora_b, token_slots, out_slices: tuple[int, ...], backend: str = "torch") -> None:
    """Multi-LoRA's second half (Punica's expand), in place on y [T, M] (the model's dtype, rows
    contiguous): for slice i of out_slices (sum M, len(out_slices) * R == N), at output offset
    o_i = sum(out_slices[:i]) and of size m_i, y[t, o_i:o_i + m_i] += buf[t, i*R:(i+1)*R] @
    lora_b[token_slots[t], o_i:o_i + m_i].T, summed in float32 and rounded to y's dtype before the
    add. lora_b [S, M, R] of y's dtype (smaller ranks zero-padded to R, alpha / r folded in); rows
    of slot -1 stay bit for bit as they were."""
    get_backend(backend).lora_expand(y, buf, lora_b, token_slots, out_slices)
