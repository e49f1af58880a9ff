"""What rank 0 broadcasts to the other ranks of its replica each step.

Followers keep no scheduler and no Request: they get the step's SchedulerOutput (plain data: new
streams once, then only what changed), split into the step's micro-batches, and run the very same
`ModelRunner.execute_model` on it, keeping their own copy of every stream. So a change to how the
runner builds its batch reaches every rank without a second code path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.distributed import pipeline
from engine.scheduler_output import SchedulerOutput

STEP, REPORT, STOP = "step", "report", "stop"


@dataclass
class StepMessage:
    kind: str  # STEP: run micro_batches; REPORT: send rank_report() to rank 0; STOP: leave
    micro_batches: list[SchedulerOutput] = field(default_factory=list)


def split_micro_batches(sched: SchedulerOutput, m: int) -> list[SchedulerOutput]:
    """The step as at most `m` micro-batches of about equal tokens (pipeline.split_micro_batches).
    The first carries the step's stream updates (every rank applies them before its first
    forward); each carries the forks of its own streams; the last carries the block copies, made
    after every forward of the step has written its blocks."""
    parts = pipeline.split_micro_batches(sched.num_scheduled_tokens, m)
    if len(parts) == 1:
        return [sched]
    micro = []
    for i, part in enumerate(parts):
        first, last = i == 0, i == len(parts) - 1
        keys = {k for k, _ in part}
        micro.append(SchedulerOutput(
            new_reqs=sched.new_reqs if first else [], cached_reqs=sched.cached_reqs if first else [],
            num_scheduled_tokens=part, forks=[f for f in sched.forks if f[0] in keys],
            block_copies=sched.block_copies if last else [],
            finished_req_ids=sched.finished_req_ids if first else []))
    return micro
