"""The model runner's persistent step inputs: device buffers that every step's flat tensors are views
of (token ids, positions, slot mapping, query starts, sequence lengths, block-table rows, sample
rows), filled from one host staging buffer by one non-blocking copy, and the running streams'
block tables, kept on the device and updated only where a stream's blocks changed.

Why: a step built from Python lists with `torch.tensor(..., device="cuda")` makes one synchronising
pageable copy per tensor, so the host waits for the device before it can queue the next kernel.
Here the host writes numpy views of a pinned buffer, `upload()` queues one copy and the block-table
updates, and nothing waits; the buffers never move, so a CUDA graph captured once reads each
step's inputs from the same addresses (engine/runner/cuda_graphs.py). On CPU the staging buffer *is* the
device buffer: no copy at all, and the same code runs and is tested.

Layout of the staging buffer (one byte tensor; each field a view at a fixed, 8-byte-aligned
offset): per-sequence fields first, then per-token fields, then the block-table updates, so a
step copies the prefix that ends at its last update.
"""

from __future__ import annotations

import numpy as np
import torch


class StepInputs:
    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device):
        self.max_num_tokens, self.max_num_seqs = max_num_tokens, max_num_seqs
        self.device = device
        self.on_cuda = device.type == "cuda"
        # One block-table row per stream of a step; a stream keeps its row across steps (see table_row).
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_table = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self._owners: list[object | None] = [None] * max_num_seqs
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.step = 0
        # (flat index into block_table, block id) pairs: a step rewrites at most every entry once.
        max_updates = max_num_seqs * max_blocks_per_seq
        fields = (("query_start_loc", torch.int32, (max_num_seqs + 1,)), ("seq_lens", torch.int32, (max_num_seqs,)),
                  ("table_rows", torch.int32, (max_num_seqs,)),
                  # a row per sequence, or per token of a speculating one (its verify rows)
                  ("sample_rows", torch.int64, (max(max_num_seqs, max_num_tokens),)),
                  ("input_ids", torch.int64, (max_num_tokens,)), ("positions", torch.int64, (max_num_tokens,)),
                  ("slot_mapping", torch.int64, (max_num_tokens,)),
                  ("lora_slots", torch.int32, (max_num_tokens,)),  # each token's adapter slot, on LoRA steps
                  ("table_updates", torch.int32, (max_updates, 2)))
        offsets, nbytes = {}, 0
        for name, dtype, shape in fields:
            offsets[name] = nbytes
            nbytes += -(-int(np.prod(shape)) * dtype.itemsize // 8) * 8
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.on_cuda)
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device) if self.on_cuda else self.host
        self._np = {}
        for name, dtype, shape in fields:
            size = int(np.prod(shape)) * dtype.itemsize
            start = offsets[name]
            self._np[name] = self.host[start:start + size].view(dtype).view(shape).numpy()
            setattr(self, name, self.buffer[start:start + size].view(dtype).view(shape))
        self._views: dict[tuple[str, int], torch.Tensor] = {}
        self._updates_offset = offsets["table_updates"]
        self._num_updates = 0
        self._first_row: int | None = None  # the staged step's rows are first_row, first_row + 1, ...
        # Recorded after each upload's copy (CUDA): the host waits on it before rewriting the buffer.
        self._copied = torch.cuda.Event() if self.on_cuda else None
        self._copy_pending = False

    # ---- block tables -----------------------------------------------------------------------

    def begin_step(self) -> None:
        """Before staging a step: the previous step's copy must have left the pinned buffer (a rank
        that never reads a result back could otherwise overwrite it while it is in flight)."""
        if self._copy_pending:
            self._copied.synchronize()
            self._copy_pending = False
        self.step += 1
        self._num_updates = 0

    def table_row(self, state) -> int:
        """The block-table row of one stream scheduled this step, with the stream's blocks not yet
        in it staged as updates. `state` carries table_row / table_blocks / table_step (the runner's
        CachedRequestState); a stream that lost its row, or was resumed (table_blocks reset), has
        its whole row rewritten."""
        row = state.table_row
        if row is None or self._owners[row] is not state:
            row = self._take_row(state)
        state.table_step = self.step
        blocks = state.block_ids
        done = state.table_blocks
        if done < len(blocks):
            assert len(blocks) <= self.max_blocks_per_seq, (
                f"a stream holds {len(blocks)} blocks, more than max_model_len allows ({self.max_blocks_per_seq})")
            n, u = len(blocks) - done, self._num_updates
            base = row * self.max_blocks_per_seq
            pairs = self._np["table_updates"]
            pairs[u:u + n, 0] = np.arange(base + done, base + len(blocks))
            pairs[u:u + n, 1] = blocks[done:]
            self._num_updates = u + n
            state.table_blocks = len(blocks)
        return row

    def _take_row(self, state) -> int:
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            # Every row is held: take one from a stream not in this step (one preempted, waiting to resume).
            row = next((r for r, owner in enumerate(self._owners) if owner.table_step != self.step), None)
            assert row is not None, f"more than max_num_seqs ({self.max_num_seqs}) streams in one step"
            self._owners[row].table_row = None
        self._owners[row] = state
        state.table_row, state.table_blocks = row, 0
        return row

    def reset(self) -> None:
        """Forget every row (after the start-up profile, whose block ids name a throwaway cache):
        a padding sequence reads row 0, which must name a block of the cache in use."""
        for state in self._owners:
            if state is not None:
                state.table_row = None
        self._owners = [None] * self.max_num_seqs
        self._free_rows = list(range(self.max_num_seqs - 1, -1, -1))
        self.block_table.zero_()

    def release(self, state) -> None:
        """A finished stream's row goes back to the free list."""
        row = state.table_row
        if row is not None and self._owners[row] is state:
            self._owners[row] = None
            self._free_rows.append(row)
        state.table_row = None

    # ---- staging and upload -----------------------------------------------------------------

    def stage(self, input_ids: list[int], positions: list[int], slot_mapping: list[int], query_start_loc: list[int],
              seq_lens: list[int], table_rows: list[int], sample_rows: list[int], num_padded_tokens: int,
              num_padded_seqs: int) -> None:
        """Write one step's inputs into the staging buffer. Tokens past the real ones up to
        num_padded_tokens are padding: token 0 at position 0, stored nowhere (slot -1). Sequences
        past the real ones up to num_padded_seqs (a CUDA graph's batch) hold one padding token each
        and see one key of block-table row 0; sample rows past the real ones read row 0. None of
        it is ever read back."""
        n, s, k = len(input_ids), len(seq_lens), len(sample_rows)
        assert num_padded_tokens <= self.max_num_tokens and num_padded_seqs <= self.max_num_seqs and k <= max(
                self.max_num_seqs, self.max_num_tokens), (
            f"a step of {num_padded_tokens} tokens / {num_padded_seqs} sequences exceeds the runner's buffers "
            f"({self.max_num_tokens} / {self.max_num_seqs}: max_num_batched_tokens / max_num_seqs)")
        a = self._np
        a["input_ids"][:n] = input_ids
        a["positions"][:n] = positions
        a["slot_mapping"][:n] = slot_mapping
        a["query_start_loc"][:s + 1] = query_start_loc
        a["seq_lens"][:s] = seq_lens
        a["table_rows"][:s] = table_rows
        first = table_rows[0] if table_rows else 0
        self._first_row = first if table_rows == list(range(first, first + s)) else None
        a["sample_rows"][:k] = sample_rows
        if num_padded_tokens > n:
            a["input_ids"][n:num_padded_tokens] = 0
            a["positions"][n:num_padded_tokens] = 0
            a["slot_mapping"][n:num_padded_tokens] = -1
        if num_padded_seqs > s:
            a["query_start_loc"][s + 1:num_padded_seqs + 1] = np.arange(n + 1, n + 1 + num_padded_seqs - s)
            a["seq_lens"][s:num_padded_seqs] = 1
            a["table_rows"][s:num_padded_seqs] = 0
        if num_padded_seqs > k:
            a["sample_rows"][k:num_padded_seqs] = 0

    def stage_lora_slots(self, slots: list[int], num_padded_tokens: int) -> None:
        """A LoRA step's per-token adapter slots (after stage(): padding tokens run no adapter)."""
        a = self._np["lora_slots"]
        a[:len(slots)] = slots
        a[len(slots):num_padded_tokens] = -1

    def upload(self) -> None:
        """Queue the staged step on the device: one non-blocking copy of the staging buffer's
        used prefix, then the block-table updates. Nothing here waits for the device."""
        u = self._num_updates
        if self.on_cuda:
            end = self._updates_offset + u * 8
            self.buffer[:end].copy_(self.host[:end], non_blocking=True)
            self._copied.record()
            self._copy_pending = True
        if u:
            pairs = self.table_updates[:u]
            self.block_table.view(-1).index_copy_(0, pairs[:, 0].long(), pairs[:, 1])
            self._num_updates = 0

    def view(self, name: str, n: int) -> torch.Tensor:
        """The first n entries of field `name` (made once per length: slicing costs more than a
        lookup, and the buffers never move)."""
        key = (name, n)
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = getattr(self, name)[:n]
        return v

    def block_tables(self, num_seqs: int, width: int | None = None) -> torch.Tensor:
        """[num_seqs, width] block table of this step's sequences, in batch order (the full width
        by default): a view of the persistent table when their rows are consecutive (always at
        batch 1), else gathered on the device."""
        table = self.block_table if width is None else self.block_table[:, :width]
        if self._first_row is not None:
            return table[self._first_row:self._first_row + num_seqs]
        return table.index_select(0, self.table_rows[:num_seqs])

    def graph_block_tables(self, num_seqs: int) -> torch.Tensor:
        """The full-width table gathered from table_rows, as a CUDA graph must read it (the rows a
        replay reads change from step to step; the addresses it reads from do not)."""
        return self.block_table.index_select(0, self.table_rows[:num_seqs])
