"""pipeline.StageClock counts completed work: an interval still running on a device (CUDA events
not yet reached) is not in the totals until it ends, and reading a total waits for it. A fake
device timer stands in for CUDA events; the host timer is checked against a sleep."""

from __future__ import annotations

import time

import torch

from engine.distributed import pipeline


class FakeDeviceTimer:
    """Marks are queued device timestamps; the test decides when the device reaches them."""

    def __init__(self):
        self.t = 0.0
        self.reached: set[int] = set()
        self.marks: list[tuple[int, float]] = []

    def mark(self):
        self.marks.append((len(self.marks), self.t))
        return self.marks[-1]

    def done(self, mark) -> bool:
        return mark[0] in self.reached

    def wait(self, mark) -> None:
        self.reached.update(range(mark[0] + 1))  # a stream reaches its marks in order

    def seconds(self, start, end) -> float:
        return end[1] - start[1]


def test_device_work_counts_once_completed_not_when_queued(monkeypatch):
    fake = FakeDeviceTimer()
    monkeypatch.setattr(pipeline, "timer_for", lambda device: fake)
    clock = pipeline.StageClock()
    dev = torch.device("cpu")  # any device: timer_for is the fake
    with clock.compute(dev):  # micro-batch 1: 2 s of device time, of which 0.5 s waiting for activations
        with clock.interval("recv_wait", dev):
            fake.t += 0.5
        fake.t += 1.5
    with clock.compute(dev):  # micro-batch 2: 3 s
        fake.t += 3.0
    clock.settle(wait=False)
    assert clock._done == {"compute": 0.0, "recv_wait": 0.0}, "queued work was counted before it ran"
    fake.reached.update({0, 1, 2, 3})  # the device finished micro-batch 1 only
    clock.settle(wait=False)
    assert clock._done == {"compute": 2.0, "recv_wait": 0.5}
    assert clock.compute_s == 5.0 and clock.recv_wait_s == 0.5 and clock.busy_s == 4.5  # waits for the rest


def test_host_timer_times_the_call():
    clock = pipeline.StageClock()
    with clock.compute(torch.device("cpu")):
        time.sleep(0.05)
    assert 0.05 <= clock.compute_s < 1.0 and clock.recv_wait_s == 0.0
