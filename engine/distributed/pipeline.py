"""Pipeline stages: activations from stage to stage, sampled tokens from the last stage back to rank 0,
and the split of one scheduled batch into micro-batches so that the stages work at the same time.

Within a step, stage s runs micro-batch k + 1 while stage s + 1 runs micro-batch k: with m
micro-batches over p equal stages a step lasts about m + p - 1 stage-slots instead of m * p, and
each stage idles (p - 1) / (m + p - 1) of it (the bubble).

No ordering of sends and receives can deadlock. On NCCL a send larger than its buffers completes
only once the peer has posted the matching receive, and each rank's point-to-point operations run
in the order they were queued; two ranks that each queue a send before the receive the other is
waiting for never finish (rank 0 queuing every micro-batch's activations, then the logits back from
the last stage, on the same stream, was such a pair). So the device group carries traffic one way
only, stage s to stage s + 1, and what goes back (the sampled tokens, a few bytes) travels over the
replica's gloo CPU group, on the host: the dependencies between ranks form a chain, never a cycle.

Sends are asynchronous (a stage moves on to its next micro-batch at once). The bubble is measured,
not assumed (`StageClock`), and on completed work: on CUDA a call returns once its kernels are
queued, so each micro-batch and each wait for activations is timed with CUDA events on the
stream that runs it; on CPU the work is done when the call returns.
"""

from __future__ import annotations

import contextlib
import pickle
import time

import torch
import torch.distributed as dist

from engine.distributed.state import pp_state, world_state


class HostTimer:
    """CPU: a call's work is done when it returns, so the host's clock times it."""

    @staticmethod
    def mark() -> float:
        return time.perf_counter()

    @staticmethod
    def done(mark: float) -> bool:
        return True

    @staticmethod
    def wait(mark: float) -> None:
        pass

    @staticmethod
    def seconds(start: float, end: float) -> float:
        return end - start


class CudaTimer:
    """CUDA: events on the current stream; an interval is known once its end event has happened."""

    @staticmethod
    def mark() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def done(mark: torch.cuda.Event) -> bool:
        return mark.query()

    @staticmethod
    def wait(mark: torch.cuda.Event) -> None:
        mark.synchronize()

    @staticmethod
    def seconds(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3


def timer_for(device: torch.device):
    return CudaTimer if device.type == "cuda" else HostTimer


class StageClock:
    """Where one rank's step time went: running the model, or stalled on the previous stage.

    `steps` and `step_s` are host wall time (on rank 0, from the broadcast to the sampled tokens in
    hand: the step's real length, since rank 0 waits for them). `compute_s` (inside the runner's
    execute_model) and `recv_wait_s` (of that, stalled until the previous stage's activations
    arrived) count completed work: intervals still running on a device are settled when they end,
    without a wait inside a step, and reading either total waits for all of them."""

    def __init__(self):
        self.steps = 0
        self.step_s = 0.0
        self._done = {"compute": 0.0, "recv_wait": 0.0}
        self._pending: list[tuple[str, object, object, object]] = []  # (kind, timer, start, end), queue order

    @contextlib.contextmanager
    def interval(self, kind: str, device: torch.device):
        timer = timer_for(device)
        start = timer.mark()
        yield
        self._pending.append((kind, timer, start, timer.mark()))
        self.settle(wait=False)

    def compute(self, device: torch.device):
        """Times one micro-batch through the runner."""
        return self.interval("compute", device)

    def settle(self, wait: bool) -> None:
        """Add the finished intervals to the totals (all of them, waiting for each, if `wait`)."""
        while self._pending:
            kind, timer, start, end = self._pending[0]
            if wait:
                timer.wait(end)
            elif not timer.done(end):
                return  # a stream runs its work in order: what was queued later has not ended either
            self._pending.pop(0)
            self._done[kind] += timer.seconds(start, end)

    @property
    def compute_s(self) -> float:
        self.settle(wait=True)
        return self._done["compute"]

    @property
    def recv_wait_s(self) -> float:
        self.settle(wait=True)
        return self._done["recv_wait"]

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
    """Hand this stage's output (hidden states and the residual stream) to the next stage: the
    only send on the device group, always forward (see the module's note on deadlocks)."""
    pp = pp_state()
    assert pp.next_rank is not None, "the last stage sends sampled tokens (send_output), not activations"
    buf = torch.stack((hidden, residual))
    _sends.append((dist.isend(buf, dst=pp.next_rank, group=pp.group), buf))


def recv_activations(num_tokens: int, hidden_size: int, dtype: torch.dtype,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    pp = pp_state()
    buf = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=device)
    # On NCCL recv returns once the current stream waits for the data; the events around it
    # then bound the time that stream stalled. On gloo it returns with the data.
    with clock.interval("recv_wait", device):
        dist.recv(buf, src=pp.prev_rank, group=pp.group)
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
