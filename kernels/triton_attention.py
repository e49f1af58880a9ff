"""Triton paged attention for any query length, and the reduce that merges split-KV parts.

Layouts are those of kernels/reference.py. One program owns one tile of rows for one KV head:
BLOCK_Q consecutive query tokens of one sequence times the GROUP query heads that share the KV
head (row r = token r // GROUP, head r % GROUP), so each key/value tile read from the cache
serves the whole group. A decode is a tile with one token; a prefill chunk is many tiles.

Programs find their sequence without any host-side list: sequence i owns program ids
[qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1), which always holds its cdiv(q_len, BLOCK_Q)
tiles (programs left over exit at once), so the grid is num_tokens // BLOCK_Q + num_seqs.

Softmax runs online in float32 in the base-2 domain (scale folded with log2(e), exp2 is one
instruction). With NUM_SPLITS > 1 each program covers one contiguous slice of the keys and writes
its normalised partial output plus log-sum-exp; split_reduce_kernel merges the slices.

An fp8 (e4m3) cache is loaded as fp8 and upcast tile by tile (exact in 16 bits); its per-tensor
scales factor out of the sums: k_scale is folded into qk_scale, v_scale multiplies the output once.

The optional features (kernels/reference.py) are constexpr flags, so a launch without them compiles
to the kernel it was before. WINDOW: a program starts at the tile holding its first row's oldest
visible key and masks only the tiles the window's edge crosses; SOFT_CAP: scores become
cap * tanh(score / cap) (in the base-2 domain: cap * log2(e) is the cap there); SINKS: each head's
sink logit joins the denominator once, after the keys (or in the reduce when split).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """The last sequence whose first program id, qsl[i] // BLOCK_Q + i, is <= pid (binary search)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^2x + 1): saturates to +-1 without overflow (e^2x = inf or 0); triton has no tanh.
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # 2 * log2(e)


@triton.jit
def _attend_tile(acc, m_i, l_i, q, start, hi, pos, table_ptr, k_cache_ptr, v_cache_ptr, kv_head,
                 stride_k_blk, stride_k_slot, stride_k_head, stride_v_blk, stride_v_slot, stride_v_head,
                 qk_scale, dims, dim_valid, window, kv_lo, soft_cap,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr):
    """Fold keys [start, start + BLOCK_N) into the running softmax state of every row.

    Both matmuls run in the query's dtype: a cache of another dtype (kv_cache_dtype) is converted
    tile by tile as it is loaded, as the reference converts it (a no-op when they match).

    MASK=False is the fast path for tiles that lie entirely below every row's causal diagonal and
    inside the key range (and window); MASK=True also hides keys past `hi`, keys after each row's
    position and, with WINDOW, keys at or before its position - window.
    """
    keys = start + tl.arange(0, BLOCK_N)
    if MASK:
        kv_valid = keys < hi
        if WINDOW:  # nor keys before every row's window: their blocks may have been released
            kv_valid = kv_valid & (keys >= kv_lo)
        # Keys past the end may index block-table columns that do not exist: do not read them.
        blocks = tl.load(table_ptr + keys // BLOCK_SIZE, mask=kv_valid, other=0)
        kv_mask = kv_valid[:, None] & dim_valid[None, :]
    else:
        blocks = tl.load(table_ptr + keys // BLOCK_SIZE)
        kv_mask = dim_valid[None, :]
    # int64: block id * block stride overflows int32 in caches past 2^31 elements.
    blocks = blocks.to(tl.int64)
    slots = keys % BLOCK_SIZE

    k = tl.load(k_cache_ptr + blocks[:, None] * stride_k_blk + slots[:, None] * stride_k_slot
                + kv_head * stride_k_head + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if SOFT_CAP:
        s = soft_cap * _tanh(s / soft_cap)
    if MASK:
        visible = kv_valid[None, :] & (keys[None, :] <= pos[:, None])
        if WINDOW:
            visible = visible & (keys[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen only masked keys keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)

    v = tl.load(v_cache_ptr + blocks[:, None] * stride_v_blk + slots[:, None] * stride_v_slot
                + kv_head * stride_v_head + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# A batch's sequence count and block-table width change from step to step: as plain ints Triton
# would specialise on them (== 1, % 16) and compile a new variant mid-serving. Nor does the
# alignment of the batch metadata, which is read a scalar at a time and may be a view into the
# runner's staging buffer. Model sizes stay specialised (their divisibility lets loads vectorise).
@triton.jit(do_not_specialize=["num_seqs", "stride_bt_seq"],
            do_not_specialize_on_alignment=["block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr"])
def paged_attention_kernel(
        out_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
        part_out_ptr, part_lse_ptr, sinks_ptr,
        qk_scale, num_seqs, window, soft_cap,
        stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
        stride_k_blk, stride_k_slot, stride_k_head, stride_v_blk, stride_v_slot, stride_v_head,
        stride_bt_seq, v_scale,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
        DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, SINKS: tl.constexpr):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq(query_start_loc_ptr, num_seqs, pid, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    num_q_blocks = tl.cdiv(q_len, BLOCK_Q)
    local = pid - (q_start // BLOCK_Q + seq)
    if local >= num_q_blocks:
        return
    # Causal tiles late in a sequence see the most keys: hand them to the earliest programs, so the
    # longest work starts first and the cheap tiles fill the tail of the launch.
    q_block = num_q_blocks - 1 - local
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len  # keys already cached before this step's queries

    rows = tl.arange(0, BLOCK_M)
    q_tok = q_block * BLOCK_Q + rows // GROUP  # query index within this sequence
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_tok < q_len)
    pos = prefix_len + q_tok  # absolute position: this row sees keys 0..pos
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM  # head dims that are not powers of two are padded with masked lanes
    tok = (q_start + q_tok).to(tl.int64)
    q = tl.load(query_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    # Keys this tile needs: up to its last token's position. Keys below its first token's position
    # are visible to every row, so whole tiles there skip the causal mask.
    first_pos = prefix_len + q_block * BLOCK_Q
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)
    # With a window, keys before the tile holding the first row's oldest visible key are skipped.
    base = 0
    kv_lo = 0  # the first key any row of the tile sees
    if WINDOW:
        kv_lo = tl.maximum(first_pos - window + 1, 0)
        base = kv_lo // BLOCK_N * BLOCK_N
    lo = base
    hi = kv_end
    if NUM_SPLITS > 1:
        tiles_per_split = tl.cdiv(tl.cdiv(seq_len - base, BLOCK_N), NUM_SPLITS)
        lo = base + split * tiles_per_split * BLOCK_N
        hi = tl.minimum(kv_end, lo + tiles_per_split * BLOCK_N)
    unmasked_limit = tl.maximum(tl.minimum(hi, first_pos + 1), lo)
    unmasked_end = lo + (unmasked_limit - lo) // BLOCK_N * BLOCK_N
    # Tiles before window_end may hold keys some row's window has left: they take the mask too.
    window_end = lo
    if WINDOW:
        window_end = tl.maximum(tl.minimum(lo + tl.cdiv(tl.maximum(kv_end - window - lo, 0), BLOCK_N) * BLOCK_N, hi),
                                lo)

    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if WINDOW:
        for start in range(lo, window_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, start, hi, pos, table_ptr, k_cache_ptr, v_cache_ptr,
                                         kv_head, stride_k_blk, stride_k_slot, stride_k_head, stride_v_blk,
                                         stride_v_slot, stride_v_head, qk_scale, dims, dim_valid, window, kv_lo,
                                         soft_cap, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, WINDOW, SOFT_CAP)
    for start in range(window_end, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, start, hi, pos, table_ptr, k_cache_ptr, v_cache_ptr,
                                     kv_head, stride_k_blk, stride_k_slot, stride_k_head, stride_v_blk,
                                     stride_v_slot, stride_v_head, qk_scale, dims, dim_valid, window, kv_lo,
                                     soft_cap, BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION, WINDOW, SOFT_CAP)
    for start in range(tl.maximum(window_end, unmasked_end), hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, start, hi, pos, table_ptr, k_cache_ptr, v_cache_ptr,
                                     kv_head, stride_k_blk, stride_k_slot, stride_k_head, stride_v_blk,
                                     stride_v_slot, stride_v_head, qk_scale, dims, dim_valid, window, kv_lo,
                                     soft_cap, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, WINDOW, SOFT_CAP)

    store_mask = row_valid[:, None] & dim_valid[None, :]
    if NUM_SPLITS == 1:
        if SINKS:  # the sink's term joins the denominator; it adds nothing to acc
            sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0) * 1.4426950408889634  # log2(e)
            m_new = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha + tl.exp2(sink - m_new)
        out = acc / l_i[:, None] * v_scale  # every valid row saw at least its own key, so l_i > 0
        tl.store(out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        # A split wholly after a row's position (or past the context) is empty: l = 0. It must
        # still write lse = -inf and a finite output so the reduce weighs it to exactly zero.
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None] * v_scale
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        num_heads = tl.num_programs(1) * GROUP
        part = (tok * num_heads + head) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], out, mask=store_mask)
        tl.store(part_lse_ptr + part, lse, mask=row_valid)


@triton.jit(do_not_specialize=["num_seqs"], do_not_specialize_on_alignment=["query_start_loc_ptr"])
def split_reduce_kernel(out_ptr, part_out_ptr, part_lse_ptr, sinks_ptr, query_start_loc_ptr, num_seqs, num_heads,
                        stride_o_tok, stride_o_head,
                        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                        BLOCK_H: tl.constexpr, SINKS: tl.constexpr):
    """out[tok, head] = sum_s w_s * part_s / sum_s w_s with w_s = 2^(lse_s - max lse), for BLOCK_H heads.
    With SINKS, the head's sink is one more weight in the denominator, with no part."""
    tok = tl.program_id(0)
    if tok >= tl.load(query_start_loc_ptr + num_seqs):
        return  # a padding row past the last sequence: the attention kernel wrote no parts for it
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_valid = heads < num_heads
    part = (tok.to(tl.int64) * num_heads + heads[:, None]) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)[None, :]
    lse = tl.load(part_lse_ptr + part, mask=head_valid[:, None], other=0.0)  # [BLOCK_H, NUM_SPLITS]
    # The max is finite: the split holding a row's own key is never empty. Empty splits weigh 0.
    top = tl.max(lse, 1)
    if SINKS:
        sink = tl.load(sinks_ptr + heads, mask=head_valid, other=0.0) * 1.4426950408889634  # log2(e)
        top = tl.maximum(top, sink)
    weight = tl.exp2(lse - top[:, None])
    total = tl.sum(weight, 1)
    if SINKS:
        total += tl.exp2(sink - top)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    parts = tl.load(part_out_ptr + part[:, :, None] * HEAD_DIM_PAD + dims[None, None, :],
                    mask=head_valid[:, None, None] & dim_valid[None, None, :], other=0.0)
    out = tl.sum(parts * weight[:, :, None], 1) / total[:, None]  # [BLOCK_H, HEAD_DIM_PAD]
    tl.store(out_ptr + tok.to(tl.int64) * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_valid[:, None] & dim_valid[None, :])
