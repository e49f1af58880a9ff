"""CoreClient: what the front end (AsyncEngine, LLM) may call on a core. EngineCore is one; the
data-parallel front (engine/frontend/data_parallel.py) is another, so that the front end drives
one core or many replicas through the same calls, with no probing for optional ones."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from engine.loading.sampling_defaults import SamplingDefaults
from engine.outputs import CoreOutput
from engine.request import LoRARequest
from engine.sampling_params import SamplingParams


@runtime_checkable
class CoreClient(Protocol):
    tokenizer: Any  # the model's Hugging Face tokenizer
    model_name: str
    max_model_len: int
    sampling_defaults: SamplingDefaults  # the model's generation_config.json, for requests that leave a field unset

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> None:
        """Queues a request that check_request passed (the front end checks each request once)."""

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Ends these requests now and frees their blocks; the next step reports them aborted."""

    def finish_choice(self, request_id: str, index: int, stop: str) -> None:
        """Ends one choice that a stop string ended in the front end's text."""

    def has_unfinished_requests(self) -> bool:
        """Tells whether a step has anything to do (or to report)."""

    def step(self) -> list[CoreOutput]:
        """Runs one step and returns its outputs, one per choice that advanced or ended."""

    def check_request(self, ids: list[int], params: SamplingParams, lora_request: LoRARequest | None = None) -> None:
        """Raises a RequestError naming the field when the request cannot be served as asked."""

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Raises a RequestError naming lora_request when this engine cannot serve the adapter."""

    def check_health(self) -> None:
        """Raises when the core cannot step any more (a worker or replica process died)."""

    def stats(self) -> dict:
        """Returns the scheduler's and the KV cache's counters as of now."""

    def shutdown(self) -> None:
        """Stops the core's worker or replica processes, if it has any; idempotent."""
