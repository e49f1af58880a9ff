"""What rank 0 broadcasts to the other ranks of its replica, and how they read it back.

Followers keep no scheduler and no requests: each step they get, per scheduled request, just
what `ModelRunner.execute_model` reads of a Request (the new tokens, the block table, where the
request stands), and run the very same `execute_model` on it. So a change to how the runner
builds its batch tensors reaches every rank without a second code path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.scheduler_output import SchedulerOutput

STEP, REPORT, STOP = "step", "report", "stop"


@dataclass
class ScheduledSlice:
    """The part of a Request that one step's forward pass reads (duck-types Request there)."""

    num_computed_tokens: int
    new_token_ids: list[int]  # the tokens this step computes, from num_computed_tokens on
    block_ids: list[int]
    num_prompt_tokens: int
    num_tokens: int
    wants_prompt_logprobs: bool

    @classmethod
    def of(cls, req, n: int) -> ScheduledSlice:
        start = req.num_computed_tokens
        return cls(start, req.token_ids_slice(start, start + n), list(req.block_ids), req.num_prompt_tokens,
                   req.num_tokens, req.prompt_logprobs is not None)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        assert start == self.num_computed_tokens and end - start <= len(self.new_token_ids)
        return self.new_token_ids[: end - start]

    @property
    def prompt_logprobs(self) -> list | None:
        return [] if self.wants_prompt_logprobs else None


@dataclass
class StepMessage:
    kind: str  # STEP: run micro_batches; REPORT: send rank_report() to rank 0; STOP: leave
    micro_batches: list[list[tuple[ScheduledSlice, int]]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # forks since the last step, applied first

    @classmethod
    def step(cls, micro_batches: list[list], block_copies: list[tuple[int, int]]) -> StepMessage:
        return cls(STEP, [[(ScheduledSlice.of(req, n), n) for req, n in mb] for mb in micro_batches], block_copies)

    def batches(self) -> list[SchedulerOutput]:
        return [SchedulerOutput(scheduled=list(mb)) for mb in self.micro_batches]
