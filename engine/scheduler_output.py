"""What one step runs, as plain data: the scheduler builds it, the executor ships it to every rank,
each rank's ModelRunner applies it to the per-stream state it keeps, runs the forward, samples and
answers with a ModelRunnerOutput. No Request crosses here (nor a process boundary).

A stream (one choice of a request, keyed "request_id#index") is sent whole once, as
NewRequestData, and afterwards only as what changed (CachedRequestData): the tokens appended to
it since the runner last saw it (the sampled ones, one per decode step), the blocks it was given,
and where its computed tokens stand. The runner forgets a stream when it is named in
`finished_req_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import LoRARequest
from engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str  # the stream's key
    index: int  # which choice of its request (a seeded choice draws from seed + index)
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens already generated, when a preempted stream comes back as new
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: LoRARequest | None = None  # the adapter its tokens run through (the runner loads it)


@dataclass
class CachedRequestData:
    req_id: str
    new_token_ids: list[int]  # appended since the runner last saw the stream
    new_block_ids: list[int]  # appended to its block table; all of it when `resumed`
    num_computed_tokens: int
    resumed: bool = False  # back from preemption: its blocks were freed and `new_block_ids` replaces them
    # Of the blocks the runner holds for the stream, those still its own: blocks that held only
    # rejected draft tokens were given back. None: all of them.
    num_kept_blocks: int | None = None


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: list[tuple[str, int]] = field(default_factory=list)  # (stream, tokens), batch order
    # n > 1: choices that start this step, sampled from the same logits row as (parent stream)
    # once its prompt is done; their partial last block is one of `block_copies`.
    forks: list[tuple[str, NewRequestData]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), made after the forward
    finished_req_ids: list[str] = field(default_factory=list)  # streams the runner may forget
    # Speculative decoding: a decoding stream's draft tokens, computed after its last token in the
    # same step (its num_scheduled_tokens counts them) and verified against the model's own choices.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.num_scheduled_tokens)

    def __bool__(self) -> bool:
        return bool(self.num_scheduled_tokens)


@dataclass
class SampledToken:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None  # top-N plus the chosen token, when asked for


@dataclass
class ModelRunnerOutput:
    """One step's answer: a token per stream that reached the end of its known tokens (and per
    fork; a speculating stream's tokens are in `verified`), the prompt logprobs of this step's
    prompt rows, the embeddings of embedding requests whose prompt is done, and the streams whose
    own data made sampling raise (the core fails their requests; the others are unaffected)."""

    sampled: list[tuple[str, SampledToken]] = field(default_factory=list)
    # (stream, index of the first prompt token these entries score, one entry per prompt token)
    prompt_logprobs: list[tuple[str, int, list[dict[int, float]]]] = field(default_factory=list)
    # (stream, what raised, the message for its client when the request's own parameters are at fault)
    failed: list[tuple[str, str, str | None]] = field(default_factory=list)
    pooled: list[tuple[str, list[float]]] = field(default_factory=list)  # embedding requests whose prompt is done
    # Streams that verified drafts: the drafts the model agreed with, in order, then its own next token,
    # and each one's top logprobs (None where the stream asks for none).
    verified: list[tuple[str, list[int], list[dict[int, float] | None]]] = field(default_factory=list)

    def extend(self, other: ModelRunnerOutput) -> None:
        self.sampled += other.sampled
        self.prompt_logprobs += other.prompt_logprobs
        self.failed += other.failed
        self.pooled += other.pooled
        self.verified += other.verified
