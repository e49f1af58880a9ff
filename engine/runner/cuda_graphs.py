"""CUDA graphs for decode steps: one graph per padded batch size, captured at start-up, replayed with
the batch padded up to the nearest captured size.

A decode step of a small model is hundreds of short kernels; launched one by one from Python the
GPU waits on the host. A graph replays them all with one launch. It reads its inputs from the
runner's persistent buffers (engine/runner/step_inputs.py) and writes the sample rows' logits into one
static output, so a replay is: stage the inputs, copy them, replay, slice the output.

Steps that are not all decodes (prefill chunks, prompt logprobs, embeddings) and batches larger
than the largest size run eagerly, as does everything with enforce_eager, on CPU (nothing to
capture: accepted, a no-op), and where capture is not supported (see ModelRunner._graphs_off).
The sizes (`capture_sizes`) and the padding decision (`DecodeGraphs.padded_size`) are plain Python
that every device runs; `DecodeGraphs(..., emulate=True)` runs the padded forward eagerly instead
of replaying it, so the padding and the buffers a graph reads are tested on CPU too.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

BATCH_SIZE_ALIGNMENT = 8  # above 8, one graph every 8 sequences (vLLM's pattern)


def capture_sizes(cuda_graph_sizes: list[int] | tuple[int, ...] | None, max_num_seqs: int) -> list[int]:
    """The decode batch sizes to capture, ascending, as vLLM reads --cuda-graph-sizes: none given,
    1, 2, 4, 8, then every 8 up to max_num_seqs; one value N, the same pattern up to N; several
    values, those sizes. Sizes above max_num_seqs are clipped to it, with a warning."""
    if cuda_graph_sizes is None or len(cuda_graph_sizes) == 1:
        top = max_num_seqs if cuda_graph_sizes is None else cuda_graph_sizes[0]
        if top > max_num_seqs:
            logger.warning("cuda_graph_sizes %d is above max_num_seqs %d: capturing up to %d", top, max_num_seqs,
                           max_num_seqs)
            top = max_num_seqs
        sizes = [s for s in (1, 2, 4) if s <= top] + list(range(BATCH_SIZE_ALIGNMENT, top + 1, BATCH_SIZE_ALIGNMENT))
        return sizes
    over = sorted(s for s in cuda_graph_sizes if s > max_num_seqs)
    if over:
        logger.warning("cuda_graph_sizes %s are above max_num_seqs %d: clipped to it", over, max_num_seqs)
    return sorted({min(s, max_num_seqs) for s in cuda_graph_sizes})


class DecodeGraphs:
    """`prepare(size)` stages a dummy decode batch of `size` sequences in the runner's buffers;
    `forward(size)` runs the decode forward of `size` (padded) sequences from those buffers and
    returns the sample rows' logits [size, vocab]. Both are the runner's."""

    def __init__(self, sizes: list[int], prepare: Callable[[int], None], forward: Callable[[int], torch.Tensor],
                 emulate: bool = False):
        self.sizes = sorted(sizes)
        self.prepare, self.forward = prepare, forward
        self.emulate = emulate  # CPU tests: run the padded forward eagerly where a graph would replay
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.output: torch.Tensor | None = None  # static logits [max size, vocab], written by every replay
        self._pool = None

    @property
    def active(self) -> bool:
        return bool(self.graphs) or (self.emulate and bool(self.sizes))

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured batch size a decode step of num_seqs sequences runs as; None: eager (no
        graphs, or a batch larger than the largest)."""
        if not self.active:
            return None
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, size: int) -> torch.Tensor:
        """The logits of a staged and uploaded decode batch padded to `size`: [size, vocab], a view
        of the static output (valid until the next run)."""
        if self.emulate:
            logits = self.forward(size)
            if self.output is None:
                self.output = logits.new_empty((self.sizes[-1], logits.shape[1]))
            self.output[:size].copy_(logits)
        else:
            self.graphs[size].replay()
        return self.output[:size]

    @torch.inference_mode()
    def capture(self, device: torch.device) -> int:
        """Capture one graph per size, largest first (smaller ones reuse its memory pool); return
        the device memory they hold, as torch.cuda.mem_get_info sees it."""
        torch.cuda.synchronize(device)
        gc.collect()
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(device)[0]
        start = time.perf_counter()
        self._pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self.prepare(size)
            for _ in range(2):  # warm up outside the graph: Triton compiles, cuBLAS picks its kernels
                logits = self.forward(size)
            if self.output is None:
                self.output = logits.new_empty((self.sizes[-1], logits.shape[1]))
            del logits
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self.output[:size].copy_(self.forward(size))
            self.graphs[size] = graph
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        used = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info("captured CUDA graphs for %d decode batch sizes (1 to %d) in %.2f s, holding %.1f MiB",
                    len(self.sizes), self.sizes[-1], time.perf_counter() - start, used / 2**20)
        return max(used, 0)

    def release(self) -> None:
        """Drop every graph and its memory (after the start-up probe that measures them)."""
        self.graphs, self.output, self._pool = {}, None, None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
