"""SchedulerOutput: what one step runs, handed from the scheduler (core) to the executor and the
model runner below it, so that neither imports the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens this step)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)
