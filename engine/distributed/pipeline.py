"""Pipeline stages: activations from stage to stage, sampled tokens from the last stage back to rank 0,
and the split of one scheduled batch into micro-batches so that the stages work at the same time.

Within a step, stage s runs micro-batch k + 1 while stage s + 1 runs micro-batch k: with m
micro-batches over p equal stages a step lasts about m + p - 1 stage-slots instead of m * p, and
each stage idles (p - 1) / (m + p - 1) of it (the bubble). Sends are asynchronous (a stage moves
on to its next micro-batch at once); receives block, and the time they block is counted, so the
bubble is measured rather than assumed (`StageClock`).
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.distributed.state import pp_state, world_state


@dataclass
class StageClock:
    """Where one rank's step time went: running the model, or blocked on the previous stage."""

    steps: int = 0
    step_s: float = 0.0  # wall time of whole steps (rank 0: from broadcast to sampled tokens in hand)
    compute_s: float = 0.0  # inside ModelRunner.execute_model
    recv_wait_s: float = 0.0  # of that, blocked receiving the previous stage's activations

    @property
    def busy_s(self) -> float:
        return self.compute_s - self.recv_wait_s


clock = StageClock()
_sends: list[tuple[object, torch.Tensor]] = []  # in-flight isends; a tensor must outlive its send


def reset() -> None:
    """A fresh clock, and no sends left over from an engine that failed mid-step (their
    process group is gone; waiting on them would fail the next engine)."""
    global clock
    clock = StageClock()
    _sends.clear()


def send_activations(hidden: torch.Tensor, residual: torch.Tensor) -> None:
    """Hand this stage's output (hidden states and the residual stream) to the next stage."""
    pp = pp_state()
    buf = torch.stack((hidden, residual))
    _sends.append((dist.isend(buf, dst=pp.next_rank, group=pp.group), buf))


def recv_activations(num_tokens: int, hidden_size: int, dtype: torch.dtype,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    pp = pp_state()
    buf = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=device)
    start = time.perf_counter()
    dist.recv(buf, src=pp.prev_rank, group=pp.group)
    clock.recv_wait_s += time.perf_counter() - start
    return buf[0], buf[1]


def wait_sends() -> None:
    """Every send of this step has left (before the step's tensors may be reused or freed)."""
    while _sends:
        work, _ = _sends.pop(0)
        work.wait()


def send_output(output, dst: int) -> None:
    """Last stage's sampling rank: one micro-batch's sampled tokens (a small object, not logits),
    pickled, over the replica's CPU group, so that no device buffer waits on rank 0."""
    data = torch.frombuffer(bytearray(pickle.dumps(output)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    group = world_state().cpu_group
    for t in (size, data):
        _sends.append((dist.isend(t, dst=dst, group=group), t))


def recv_output(src: int):
    """Rank 0: what send_output sent, in the order it was sent."""
    group = world_state().cpu_group
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src=src, group=group)
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(data, src=src, group=group)
    return pickle.loads(data.numpy().tobytes())


def split_micro_batches(scheduled: list, m: int) -> list[list]:
    """At most `m` contiguous slices of the scheduled (stream, tokens) pairs with about equal
    token counts. A request is never split, so a lone long prefill chunk stays one micro-batch."""
    m = min(m, len(scheduled))
    if m <= 1:
        return [scheduled]
    total = sum(n for _, n in scheduled)
    slices, current, done = [], [], 0
    for i, (req, n) in enumerate(scheduled):
        current.append((req, n))
        done += n
        cuts_left = m - len(slices) - 1
        items_left = len(scheduled) - i - 1
        if cuts_left > 0 and (done >= total * (len(slices) + 1) / m or items_left == cuts_left):
            slices.append(current)
            current = []
    if current:
        slices.append(current)
    return slices
