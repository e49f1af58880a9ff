"""What the engine hands back.

The core emits `CoreOutput`s: per choice and per step, only what is new (token ids, their
logprobs, a finish). The front end's OutputProcessor turns them into `RequestOutput`s: one per
request, one `CompletionOutput` per choice, either deltas (the server streams them) or, for the
offline LLM API, complete outputs once a request finishes. Nothing here grows with the length of
an output except what the caller keeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# For each position: {token_id: logprob}. The chosen token is always present.
PositionLogprobs = dict[int, float]


@dataclass
class CoreOutput:
    """One choice's news from one engine step: plain data, cheap to pickle across processes."""

    request_id: str
    index: int  # which of the request's n choices
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[PositionLogprobs] | None = None  # one entry per new token, when asked for
    finish_reason: str | None = None  # "stop" | "length" | "abort" once this choice ends
    stop_reason: int | str | None = None  # the stop token id that ended it
    request_finished: bool = False  # every choice of the request has ended: the core forgot it
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # with the request's first output
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (with the first output)
    error: str | None = None  # the core failed this request (every choice ends)
    embedding: list[float] | None = None  # an embedding request's result (it then ends)
    invalid_request: bool = False  # the error is the request's own (its parameters), not the engine's


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's outputs: in delta mode `outputs` holds the choices with news and each carries
    only its new text, token ids and logprobs; in final mode every choice, complete."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # set when the engine rejected or failed this request
    embedding: list[float] | None = None  # an embedding request's pooled final hidden states, normalised
    invalid_request: bool = False  # the error is the request's own (its parameters), not the engine's
    # When the request reached the front end, and (when, new tokens) for each step since the previous
    # output that gave it tokens, on time.perf_counter's clock: latency metrics read them, so they mean
    # the same whether the consumer takes deltas or one whole output.
    arrival_time: float | None = None
    token_times: list[tuple[float, int]] = field(default_factory=list)

    def merge(self, later: RequestOutput) -> RequestOutput:
        """This delta followed by `later` as one delta (a consumer that fell behind gets one
        larger update instead of a backlog)."""
        choices = {c.index: c for c in self.outputs}
        for c in later.outputs:
            if c.index not in choices:
                choices[c.index] = c
                continue
            a = choices[c.index]
            choices[c.index] = CompletionOutput(
                c.index, a.text + c.text, a.token_ids + c.token_ids, c.cumulative_logprob,
                None if a.logprobs is None and c.logprobs is None else (a.logprobs or []) + (c.logprobs or []),
                c.finish_reason, c.stop_reason)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [choices[i] for i in sorted(choices)], later.finished,
                             self.prompt_logprobs or later.prompt_logprobs,
                             max(self.num_cached_tokens, later.num_cached_tokens), later.error or self.error,
                             later.embedding or self.embedding, later.invalid_request or self.invalid_request,
                             self.arrival_time, self.token_times + later.token_times)
