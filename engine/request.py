"""The user's request and its choices: a ParentRequest holds n Requests, each one generation stream
(one choice) moving through waiting -> running -> finished. The first choice prefills the prompt;
the others are forked from it once the prompt is done, sharing its KV blocks."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with (vLLM's LoRARequest): a PEFT folder (adapter_config.json +
    adapter_model.safetensors), named for clients, with an integer id unique per adapter, which keys
    the runner's slots and salts the prefix cache (two adapters never share KV)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None  # the model it was trained on, as /v1/models lists its parent

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1 (0 is the base model), got {self.lora_int_id!r}")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; its KV is recomputed when rescheduled
    FINISHED = "finished"


class TokenSequence:
    """Prompt plus output tokens, read by position: the scheduler's Request and the runner's copy
    of a stream (engine.runner.runner_streams.CachedRequestState) both are one."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list (a decode step
        reads one token: O(1), however long the output)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]


class Request(TokenSequence):
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 index: int = 0, arrival_time: float | None = None, lora_request: LoRARequest | None = None):
        self.request_id = request_id
        self.lora_request = lora_request
        self.index = index  # which of the parent's n choices this stream is
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.status = RequestStatus.WAITING
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # of the prompt, found in the prefix cache at first scheduling
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # hashes of this request's full blocks, in order
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if sampling_params.prompt_logprobs is not None else None)
        self.forked = sampling_params.n == 1  # n > 1: the parent forks its choices once its prompt is done
        # What the runner holds of this stream (the scheduler sends only what changed):
        self.num_sent_tokens = 0  # of prompt + output; 0: the runner does not know the stream
        self.num_sent_blocks = 0  # of block_ids
        self.resumed = False  # preempted since last sent: the runner's block table is stale

    @property
    def key(self) -> str:
        """Unique per stream: the request id plus the choice index."""
        return f"{self.request_id}#{self.index}"

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id; 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED


class ParentRequest:
    """What the user asked for: one prompt, its sampling parameters, and its n choices (None
    until forked). Tracked by EngineCore until every choice has ended."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 lora_request: LoRARequest | None = None):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.lora_request = lora_request
        self.choices: list[Request | None] = [None] * sampling_params.n
        self.num_cached_tokens = 0
        self.ended = False  # aborted or failed: choices never started are finished too

    @property
    def finished(self) -> bool:
        return self.ended or all(c is not None and c.is_finished for c in self.choices)

    def unfinished_indexes(self) -> list[int]:
        return [i for i, c in enumerate(self.choices) if c is None or not c.is_finished]
