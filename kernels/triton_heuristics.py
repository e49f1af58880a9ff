"""Launch choices for the Triton paged-attention kernel: tile shapes and the split-KV decision.

Plain Python on shapes the host already knows (never a value read back from the GPU), so choosing
costs no synchronisation and a step stays CUDA-graph friendly. No triton import: testable anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

# A batch whose sequences bring at least this many query tokens on average is treated as prefill.
PREFILL_MIN_AVG_QUERY = 8
# Each split must read at least this many keys: K+V of 128 keys is 64 KiB per KV head (d=128,
# 16-bit; 32 KiB at d=64), while its partial result costs group * (d + 1) * 4 bytes (about 4 KiB for
# group 8, 1 KiB for a 1B model's group 4 at d=64), so the extra traffic of splitting stays a few
# percent of the context read. 128 rather than 256, because twice the splits made a batch-1 decode
# step of a 1B shape at context 1,024 faster on an H200, each split's keys one 128-key tile
# (BENCHMARKS.md, "GPU").
MIN_KEYS_PER_SPLIT = 128
MAX_SPLITS = 32
# Programs in flight per SM that a memory-bound decode needs to keep enough loads outstanding.
PROGRAMS_PER_SM = 2


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # query rows per program: block_m // group tokens x the group of query heads
    block_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def prev_power_of_2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def decode_smem_bytes(block_m: int, block_n: int, head_dim_pad: int, kv_bytes: int, num_stages: int) -> int:
    """Shared memory a decode program's pipeline holds: K and V tiles for each stage, plus the query."""
    return num_stages * 2 * block_n * head_dim_pad * kv_bytes + block_m * head_dim_pad * 4


def tile_config(num_tokens: int, num_seqs: int, group: int, head_dim_pad: int, kv_bytes: int = 2,
                smem_bytes: int | None = None) -> TileConfig:
    """Tiles for one launch; the whole flat batch shares them. kv_bytes: bytes of a cache element;
    smem_bytes: the shared memory a program may take on this GPU (None: unknown, the interpreter)."""
    min_m = max(16, next_power_of_2(group))  # tl.dot needs M >= 16; one tile holds a whole group
    block_n = 64 if head_dim_pad <= 128 else 32
    if num_tokens < PREFILL_MIN_AVG_QUERY * max(num_seqs, 1):
        # Decode reads K/V once per query: bandwidth-bound, so the smallest tile that holds the head
        # group (no wasted tensor-core work on empty rows) and a deep pipeline of key loads. A mixed
        # batch lands here too when decodes dominate: its prefill chunks then take more, smaller
        # programs, which re-read their context from L2 rather than from HBM. Where shared memory
        # holds three stages of 128 keys (an H100/H200 with a 16-bit or fp8 cache), that longer
        # tile, since it keeps more loads in flight and reads well above the 64-key tile's share of
        # copy bandwidth (BENCHMARKS.md, "GPU").
        if smem_bytes is not None and decode_smem_bytes(min_m, 128, head_dim_pad, kv_bytes, 3) <= smem_bytes:
            block_n = 128
        return TileConfig(min_m, block_n, 4, 3)
    if head_dim_pad <= 128:
        # FlashAttention-2 shape for Ampere/Hopper: 128x64 tiles, 8 warps, K+V stages of 32 KiB.
        return TileConfig(max(128, min_m), block_n, 8, 3)
    return TileConfig(max(64, min_m), block_n, 8, 2)  # d=256: halve both tiles to fit shared memory


def num_kv_splits(num_busy_programs: int, max_context: int, num_sms: int) -> int:
    """How many parts to split each sequence's keys into (1 = no split; always a power of two).

    A decode step at small batch launches about num_seqs * num_kv_heads programs. When that is
    fewer than the GPU has SMs, most of the memory bandwidth sits idle while each program walks a
    long context alone (batch 1, 8 KV heads: 8 programs on 132 SMs). Splitting the keys into parts
    that separate programs read in parallel, then merging the parts by their log-sum-exp in a small
    reduce kernel, fills the machine. It pays only for long contexts: every split must read at
    least MIN_KEYS_PER_SPLIT keys, so short contexts and large batches never split.
    """
    if num_busy_programs >= num_sms:
        return 1
    wanted = next_power_of_2(-(-PROGRAMS_PER_SM * num_sms // max(num_busy_programs, 1)))
    allowed = prev_power_of_2(max_context // MIN_KEYS_PER_SPLIT)
    return max(1, min(wanted, allowed, MAX_SPLITS))
