"""Pure-torch paged attention and KV-cache ops: the CPU path and the oracle for Triton.

Layouts (shared with the Triton kernels):
  key / value      [num_tokens, num_kv_heads, head_dim]        new tokens of this step, flat
  query / output   [num_tokens, num_heads, head_dim]
  k_cache/v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
  slot_mapping     [num_tokens] int: block_id * block_size + offset; -1 = padding, skip
  block_tables     [num_seqs, max_blocks_per_seq] int: physical block ids (padding entries ignored)
  query_start_loc  [num_seqs + 1] int: sequence i owns query rows [qsl[i], qsl[i+1])
  seq_lens         [num_seqs] int: context length after this step (cached + new tokens)

The new queries of a sequence are its last q_len positions: query row j of sequence i sits at
position seq_lens[i] - q_len + j and attends causally to keys 0..that position. A decode step
(q_len = 1), a prefill chunk that continues a cached prefix and a whole prompt are one op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store each new token's key and value at its slot; slots < 0 are padding and skipped."""
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    slots = slot_mapping.long()
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    assert k_flat.shape[0] == k_cache.shape[0] * block_size
    k_flat.index_copy_(0, slots, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[num_seqs, n_blocks] block ids -> [num_seqs, num_kv_heads, n_blocks*block_size, head_dim]."""
    blocks = cache[block_table.clamp(min=0).long()]  # [S, nb, bs, H, D]
    s, nb, bs, h, d = blocks.shape
    return blocks.view(s, nb * bs, h, d)[:, :length].transpose(1, 2)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys and values."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    gqa = num_heads != num_kv_heads
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]

    # Decodes (one query each) run as one padded batch: the common case of a serving step.
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if decode:
        idx = torch.tensor(decode, device=query.device)
        max_len = max(lens[i] for i in decode)
        n_blocks = -(-max_len // block_size)
        table = block_tables[idx, :n_blocks]
        k = _gather(k_cache, table, max_len)
        v = _gather(v_cache, table, max_len)
        rows = query_start_loc[idx].long()
        q = query[rows].unsqueeze(2)  # [S, H, 1, D]
        lens_t = seq_lens[idx].to(query.device)
        mask = torch.arange(max_len, device=query.device)[None, :] < lens_t[:, None]
        # Slots past a shorter sequence's length hold whatever an earlier owner (or nothing) left
        # there; a NaN among them would survive the mask (NaN * 0 = NaN), so zero them first.
        keep = mask[:, None, :, None]
        k, v = k.masked_fill(~keep, 0), v.masked_fill(~keep, 0)
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask[:, None, None, :],
                                           scale=scale, enable_gqa=gqa)
        out[rows] = o.squeeze(2)

    # Prefill chunks: one sequence at a time, causal with the cached prefix in front.
    for i, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        seq_len = lens[i]
        n_blocks = -(-seq_len // block_size)
        table = block_tables[i: i + 1, :n_blocks]
        k = _gather(k_cache, table, seq_len).to(query.dtype)
        v = _gather(v_cache, table, seq_len).to(query.dtype)
        q = query[starts[i]: starts[i + 1]].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        if q_len == seq_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= pos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[starts[i]: starts[i + 1]] = o[0].transpose(0, 1)
    return out


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks src[i] -> dst[i] (copy-on-write of a shared partial block)."""
    k_cache[dst.long()] = k_cache[src.long()]
    v_cache[dst.long()] = v_cache[src.long()]
