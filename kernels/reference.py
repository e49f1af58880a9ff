"""Pure-torch paged attention and KV-cache ops: the CPU path and the oracle for Triton.

Layouts (shared with the Triton kernels):
  key / value      [num_tokens, num_kv_heads, head_dim]        new tokens of this step, flat
  query / output   [num_tokens, num_heads, head_dim]
  k_cache/v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
  slot_mapping     [num_tokens] int: block_id * block_size + offset; -1 = padding, skip
  block_tables     [num_seqs, max_blocks_per_seq] int: physical block ids (padding entries ignored)
  query_start_loc  [num_seqs + 1] int: sequence i owns query rows [qsl[i], qsl[i+1])
  seq_lens         [num_seqs] int: context length after this step (cached + new tokens)

An fp8 cache (kv_cache_dtype "fp8", e4m3 as vLLM's) holds x / scale rounded to e4m3, saturated at
+-448, with one float scale per tensor (k_scale, v_scale; 1.0 without calibrated ones, as vLLM
uses); attention reads e4m3 * scale. Other cache dtypes ignore the scales.

The new queries of a sequence are its last q_len positions: query row j of sequence i sits at
position seq_lens[i] - q_len + j and attends causally to keys 0..that position. A decode step
(q_len = 1), a prefill chunk that continues a cached prefix and a whole prompt are one op.

Three optional features, off by default (transformers' conventions):
  sliding_window   a query at position p sees only keys at positions > p - window (window keys, itself
                   included); a prefill chunk reads only the blocks from the one its first row's window starts in
  logits_soft_cap  each scaled score s becomes cap * tanh(s / cap) before the softmax (Gemma 2)
  sinks            [num_heads] float: one logit per query head that joins its row's softmax
                   denominator as a key with no value (gpt-oss): out = sum_j e^s_j v_j / (e^sink + sum_j e^s_j)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


FP8_E4M3 = getattr(torch, "float8_e4m3fn", None)  # None in a torch without float8 dtypes
FP8_E4M3_MAX = 448.0  # the largest finite e4m3 value


def is_fp8(dtype: torch.dtype) -> bool:
    return FP8_E4M3 is not None and dtype == FP8_E4M3


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as a cache of `dtype` stores it: fp8 = x / scale in float32, clamped to +-448 (a cast
    alone may turn an out-of-range value into NaN), rounded to e4m3; other dtypes a plain cast."""
    if not is_fp8(dtype):
        return x.to(dtype)
    return (x.float() / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cache elements as attention reads them, in `dtype`: fp8 = e4m3 * scale in float32."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store each new token's key and value at its slot; slots < 0 are padding and skipped."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    slots = slot_mapping.long()
    for cache, new, scale in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
        new = quantize_kv(new, cache.dtype, scale)
        if is_fp8(cache.dtype):  # index_copy_ has no float8 kernel: move the same bytes as uint8
            cache, new = cache.view(torch.uint8), new.view(torch.uint8)
        head_major = cache.permute(2, 0, 1, 3)
        if head_major.is_contiguous():  # allocate_kv_cache's CPU layout: [heads, blocks * block_size, D]
            head_major.view(cache.shape[2], -1, cache.shape[3]).index_copy_(1, slots, new.transpose(0, 1))
        else:
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, new)


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """A zeroed cache of logical shape [num_blocks, block_size, num_kv_heads, head_dim], stored
    head-major ([heads, blocks, block_size, D]) underneath: a decode gather then comes out as
    [heads, seqs, keys, D], the contiguous batch the matmuls want, with no permute copy."""
    return torch.zeros(num_kv_heads, num_blocks, block_size, head_dim, dtype=dtype, device=device).permute(1, 2, 0, 3)


@dataclass
class AttentionPlan:
    """Everything about a step's batch that every layer would otherwise recompute: which rows are
    decodes, their padded key mask and flattened block ids, and each prefill's extent."""

    decode_rows: torch.Tensor | None  # query rows of the one-token sequences
    decode_blocks: torch.Tensor | None  # [num_decodes * n_blocks] block ids, row-major
    decode_valid: torch.Tensor | None  # [num_decodes, 1, n_blocks * block_size]: key slot inside the sequence
    decode_invalid: torch.Tensor | None  # its negation, for an in-place fill
    decode_len: int
    all_decode: bool  # every sequence decodes: query rows are 0..n-1, no row gather or scatter
    prefills: list[tuple[int, int, int, torch.Tensor]]  # (first row, last row + 1, seq_len, block ids)


def plan_attention(block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                   block_size: int) -> AttentionPlan:
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    prefills = []
    for i in range(len(lens)):
        if starts[i + 1] - starts[i] > 1:
            n_blocks = -(-lens[i] // block_size)
            prefills.append((starts[i], starts[i + 1], lens[i], block_tables[i, :n_blocks].long()))
    if not decode:
        return AttentionPlan(None, None, None, None, 0, False, prefills)
    dev = block_tables.device
    idx = torch.tensor(decode, device=dev)
    n_blocks = -(-max(lens[i] for i in decode) // block_size)
    padded = n_blocks * block_size
    valid = torch.arange(padded, device=dev)[None, :] < seq_lens[idx].to(dev)[:, None]
    blocks = block_tables[idx, :n_blocks].clamp(min=0).long().flatten()
    valid = valid[:, None, :]
    return AttentionPlan(query_start_loc[idx].long(), blocks, valid, ~valid, padded, not prefills, prefills)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Flattened block ids -> [num_kv_heads, num_seqs, n_blocks * block_size, head_dim], contiguous."""
    _, _, h, d = cache.shape
    head_major = cache.permute(2, 0, 1, 3)
    if head_major.is_contiguous():
        return head_major.index_select(1, blocks).view(h, num_seqs, -1, d)
    return cache.index_select(0, blocks).view(num_seqs, -1, h, d).permute(2, 0, 1, 3).contiguous()


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, plan: AttentionPlan | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0, sliding_window: int | None = None, logits_soft_cap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys and values.
    `plan` (from plan_attention) may be shared by all layers of a step; it is built if absent.
    k_scale / v_scale: an fp8 cache's scales (dequantize_kv); ignored for other caches.
    sliding_window / logits_soft_cap / sinks: the module docstring's optional features."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    plan = plan or plan_attention(block_tables, query_start_loc, seq_lens, k_cache.shape[1])
    out = torch.empty_like(query)

    if plan.decode_rows is not None:
        # Decodes (one query each) as one padded batch, the common serving step. Grouped-query
        # heads share their KV head through a reshape, not a copy: q [S, Hkv, group, D].
        s = plan.decode_rows.numel()
        # Batched over (KV head, sequence); a KV head's `group` query heads are the rows of one matmul.
        k = dequantize_kv(_gather(k_cache, plan.decode_blocks, s), query.dtype, k_scale)  # [Hkv, S, L, D]
        v = dequantize_kv(_gather(v_cache, plan.decode_blocks, s), query.dtype, v_scale)
        q = query if plan.all_decode else query[plan.decode_rows]
        q = (q.view(s, num_kv_heads, group, head_dim) * scale).transpose(0, 1).contiguous()  # [Hkv, S, G, D]
        # Slots past a sequence's length hold another request's data (or a padding block's).
        # A fill, not an additive mask, so a NaN key there scores -inf all the same.
        scores = torch.matmul(q, k.transpose(-1, -2)).float()
        invalid = plan.decode_invalid
        if sliding_window is not None:  # keys at or below position len - 1 - window are out of sight
            first = plan.decode_valid.sum(dim=-1, keepdim=True) - sliding_window  # [S, 1, 1]
            invalid = invalid | (torch.arange(plan.decode_len, device=k.device) < first)
        if logits_soft_cap is not None:
            scores = _soft_cap(scores, logits_soft_cap)
        scores = scores.masked_fill_(invalid, float("-inf"))
        if sinks is None:
            probs = scores.softmax(dim=-1).to(query.dtype)
        else:
            sink = sinks.float().view(1, num_kv_heads, group, 1).transpose(0, 1).expand(-1, s, -1, -1)
            probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1].to(query.dtype)
        o = torch.matmul(probs, v)  # [Hkv, S, G, D]
        if not bool(torch.isfinite(o.sum())):
            # A zero probability times a NaN value is NaN: zero the values outside each sequence
            # and redo. Checked by one reduction of the small output; the common case pays nothing.
            o = torch.matmul(probs, v.masked_fill(invalid.transpose(1, 2), 0))
        o = o.transpose(0, 1).reshape(s, num_heads, head_dim)
        if plan.all_decode:
            return o
        out[plan.decode_rows] = o

    # Prefill chunks: one sequence at a time, causal with the cached prefix in front.
    gqa = group != 1
    for first, last, seq_len, blocks in plan.prefills:
        q_len = last - first
        start = 0  # with a window, the first block that any row of the chunk sees
        if sliding_window is not None:
            block_size = k_cache.shape[1]
            start = max(0, seq_len - q_len - sliding_window + 1) // block_size * block_size
            blocks = blocks[start // block_size:]
        k = dequantize_kv(_gather(k_cache, blocks, 1).transpose(0, 1)[:, :, :seq_len - start], query.dtype, k_scale)
        v = dequantize_kv(_gather(v_cache, blocks, 1).transpose(0, 1)[:, :, :seq_len - start], query.dtype, v_scale)
        q = query[first:last].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        if q_len == seq_len and sliding_window is None and logits_soft_cap is None and sinks is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            keys = torch.arange(start, seq_len, device=query.device)[None, :]
            mask = keys <= pos[:, None]
            if sliding_window is not None:
                mask &= keys > pos[:, None] - sliding_window
            if logits_soft_cap is None and sinks is None:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
            else:
                o = _attention_with_cap_and_sinks(q, k, v, mask, scale, logits_soft_cap, sinks)
        out[first:last] = o[0].transpose(0, 1)
    return out


def _soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(scores / cap) * cap


def _attention_with_cap_and_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                                  scale: float, soft_cap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """q [1, H, Q, D], k / v [1, Hkv, L, D], mask [Q, L]: the softmax written out, as SDPA has no
    soft-capping or sink column."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float() * scale, k.float().transpose(-1, -2))
    if soft_cap is not None:
        scores = _soft_cap(scores, soft_cap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(1, -1, scores.shape[2], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    return torch.matmul(probs.to(q.dtype), v)


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks src[i] -> dst[i] (copy-on-write of a shared partial block)."""
    k_cache[dst.long()] = k_cache[src.long()]
    v_cache[dst.long()] = v_cache[src.long()]


# ---- the elementwise ops around the matmuls --------------------------------------------------------
# Rounded as transformers' eager Llama code rounds them in 16-bit dtypes (the parity oracle).


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Without residual: weight * norm(x). With residual: (weight * norm(x + residual), x + residual)."""
    if residual is not None:
        x = x + residual
    if x.dtype == torch.float32:
        y = F.rms_norm(x, weight.shape, weight, eps)
    else:
        # Statistics in float32 as transformers' LlamaRMSNorm computes them, but from one
        # float32-accumulating reduction instead of an upcast copy of x (CPU's rms_norm makes two).
        rms = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
        inv = torch.rsqrt(rms.square_().div_(x.shape[-1]).add_(eps))
        y = weight * (x * inv).to(x.dtype)
    return y if residual is None else (y, x)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/sin [T, 1, D/2]: rotate the two halves of each head,
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] = [gate | up] -> silu(gate) * up (SwiGLU)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Structured output: set to -inf, in place, the tokens each row's bitmask forbids. bitmask
    [rows, ceil(vocab / 32)] int32, bit j of word w set when token 32 * w + j is allowed
    (xgrammar's layout)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).reshape(bitmask.shape[0], -1)[:, :logits.shape[1]]
    logits.masked_fill_(allowed == 0, float("-inf"))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy sampling: each [B, V] row's first maximum, NaN counting as largest, int64 [B].
    max(dim).indices rather than argmax: the same index, and on CPU ~7x faster for bfloat16 rows."""
    return logits.max(dim=-1).indices


ARGMAX_CHUNK = 1024  # columns of a row the first pass of chunked_argmax reduces together


def chunked_argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax's answer in two passes: each 1024-column chunk's first maximum, then the first chunk
    holding the row's maximum. On a GPU torch reduces a row in one thread block, so a lone row of a
    128K vocabulary is one block's serial work, a few percent of a batch-1 decode step of a
    Llama-3.2-1B shape. Padding reads as -inf, which never beats a
    real column (an all -inf row still answers 0) and never shadows a NaN."""
    rows, vocab = logits.shape
    if vocab < 4 * ARGMAX_CHUNK:
        return argmax(logits)
    pad = -vocab % ARGMAX_CHUNK
    if pad:
        logits = torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
    values, index = logits.reshape(rows, -1, ARGMAX_CHUNK).max(dim=-1)
    chunk = values.max(dim=-1).indices
    return chunk * ARGMAX_CHUNK + index.gather(1, chunk[:, None]).squeeze(1)


# ---- mixture of experts -----------------------------------------------------------------------------
# Expert weights are stacked per layer: w13 [experts, 2 * ffn, hidden] (gate rows, then up rows) and
# w2 [experts, hidden, ffn]. A rank may hold a slice of them: a run of whole experts starting at
# `expert_offset` (expert parallel), or every expert's slice of ffn (tensor parallel); either way its
# output is a partial sum the layer all-reduces.


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing in float32: each token's top_k experts (ids [T, top_k] int64) and their
    weights ([T, top_k] float32), renormalised to sum to 1 over the chosen experts when asked
    (Mixtral always; Qwen MoE when config.norm_topk_prob)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor, expert_offset: int = 0, packed=None) -> torch.Tensor:
    """sum over each token's chosen experts e held here (expert_offset <= e < expert_offset +
    len(w13)) of weight * w2[e] @ silu_and_mul(w13[e] @ x); experts held elsewhere add nothing.
    The oracle: a loop over the experts, each on the tokens routed to it, combined in float32.
    `packed` (a backend's packed expert weights) is ignored here."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    local_ids = topk_ids - expert_offset
    for e in range(w13.shape[0]):
        token, slot = torch.nonzero(local_ids == e, as_tuple=True)
        if token.numel() == 0:
            continue
        h = silu_and_mul(F.linear(x[token], w13[e]))
        y = F.linear(h, w2[e])
        out.index_add_(0, token, y.float() * topk_weights[token, slot, None])
    return out.to(x.dtype)


# ---- multi-LoRA -------------------------------------------------------------------------------------
# One step serves tokens of several adapters and of the base model together (Punica's shrink / expand).
# Each adapter sits in a slot of stacked weights: lora_a [slots, N, K] (a fused projection stacks one A
# per part, N = parts * R) and lora_b [slots, M, R] (one B per part, stacked along the output rows);
# ranks below R are zero-padded and the scaling alpha / r is folded into lora_b. token_slots [T] int32
# gives each token's slot, -1 for a token of the base model.


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """buf [T, N] float32: buf[t] = x[t] @ lora_a[token_slots[t]].T in float32; rows of slot -1 are 0."""
    buf = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for slot in token_slots.unique().tolist():
        if slot < 0:
            continue
        rows = torch.nonzero(token_slots == slot).squeeze(1)
        buf[rows] = x[rows].float() @ lora_a[slot].float().T
    return buf


def lora_expand(y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor,
                out_slices: tuple[int, ...]) -> None:
    """In place: for slice i (output rows o_i .. o_i + m_i, o_i = sum(out_slices[:i])),
    y[t, o_i:o_i + m_i] += (buf[t, i*R:(i+1)*R] @ lora_b[token_slots[t], o_i:o_i + m_i].T).to(y.dtype),
    the product in float32; rows of slot -1 are left as they are."""
    rank = lora_b.shape[2]
    assert sum(out_slices) == y.shape[1] == lora_b.shape[1] and len(out_slices) * rank == buf.shape[1]
    for slot in token_slots.unique().tolist():
        if slot < 0:
            continue
        rows = torch.nonzero(token_slots == slot).squeeze(1)
        offset = 0
        for i, size in enumerate(out_slices):
            delta = buf[rows, i * rank:(i + 1) * rank] @ lora_b[slot, offset:offset + size].float().T
            y[rows, offset:offset + size] += delta.to(y.dtype)
            offset += size
