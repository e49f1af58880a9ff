"""OutputProcessor: the front end's half of a step. The core says which tokens each choice got;
this detokenizes them, applies stop strings (holding back text a stop string may still claim),
attaches logprobs, and builds RequestOutputs: deltas for streaming consumers, or one complete
output once a request finishes (the offline LLM API, the server's whole responses).

Work per step is proportional to the new tokens, not to the output so far. A stop string is
found here, so the processor reports it (`stopped`) for the caller to end that choice in the core.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.frontend.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, CoreOutput, PositionLogprobs, RequestOutput
from engine.sampling_params import SamplingParams


@dataclass
class _Choice:
    detokenizer: IncrementalDetokenizer
    num_tokens: int = 0
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Final mode only: everything so far (text as pieces, joined once at the end).
    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    delta: bool
    choices: list[_Choice]
    arrival_time: float = 0.0
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    embedding: list[float] | None = None
    token_times: list[tuple[float, int]] = field(default_factory=list)  # not yet handed out

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)


@dataclass
class _News:
    """One choice's news in one step."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)

    def add(self, token_id: int, entry: PositionLogprobs | None) -> None:
        self.token_ids.append(token_id)
        if entry is not None:
            self.logprobs.append(entry)


@dataclass
class StopString:
    """A choice that the processor ended on a stop string: the core must end it too."""

    request_id: str
    index: int
    stop: str


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, _Request] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    delta: bool = True, arrival_time: float | None = None) -> None:
        """delta: hand out each step's news (streaming), else one whole output when the request ends."""
        choices = [_Choice(IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                                                  params.stop, params.include_stop_str_in_output),
                           logprobs=None if delta or params.logprobs is None else [])
                   for _ in range(params.n)]
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        self.requests[request_id] = _Request(request_id, prompt, prompt_token_ids, params, delta, choices, arrival)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Forget the request; its last output, in which every unfinished choice ends with reason
        "abort" (whole, with the text so far, in final mode), or None if it was not here."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        unfinished = [i for i, c in enumerate(req.choices) if c.finish_reason is None]
        for i in unfinished:
            req.choices[i].finish_reason = "abort"
        return self._output(req, {i: _News() for i in unfinished}, None)[0]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def process(self, core_outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[StopString]]:
        """This step's RequestOutputs (one per request with news), and the choices a stop string ended."""
        news: dict[str, dict[int, _News]] = {}  # request -> choice index -> this step's news
        stops: list[StopString] = []
        errors: dict[str, CoreOutput] = {}
        for out in core_outputs:
            req = self.requests.get(out.request_id)
            if req is None:
                continue  # aborted here, or a choice's tokens after its stop string
            touched = news.setdefault(out.request_id, {})
            if out.error is not None:
                errors[out.request_id] = out
                for c in req.choices:
                    c.finish_reason = c.finish_reason or "abort"
                continue
            if out.prompt_logprobs is not None:
                req.prompt_logprobs = out.prompt_logprobs
            if out.embedding is not None:
                req.embedding = out.embedding
            req.num_cached_tokens = max(req.num_cached_tokens, out.num_cached_tokens)
            choice = req.choices[out.index]
            if choice.finish_reason is not None:
                continue
            item = touched.setdefault(out.index, _News())
            stop = self._add_tokens(req, choice, out, item)
            if stop is not None:
                stops.append(StopString(out.request_id, out.index, stop))
            item.text += choice.detokenizer.take(choice.finish_reason is not None)
        results = []
        now = time.perf_counter()
        for request_id, touched in news.items():
            req = self.requests[request_id]
            new = sum(len(item.token_ids) for item in touched.values())
            if new:
                req.token_times.append((now, new))
            results += self._output(req, touched, errors.get(request_id))
            if req.finished:
                del self.requests[request_id]
        return results, stops

    @staticmethod
    def _add_tokens(req: _Request, choice: _Choice, out: CoreOutput, item: _News) -> str | None:
        """Take the choice's new tokens; returns the stop string one of them completed, if any
        (the tokens after it are dropped: the choice ended there)."""
        last = len(out.new_token_ids) - 1
        for i, tok in enumerate(out.new_token_ids):
            choice.num_tokens += 1
            entry = out.new_logprobs[i] if out.new_logprobs is not None else None
            if entry is not None:
                choice.cumulative_logprob += entry[tok]
            item.add(tok, entry)
            if not req.delta:
                choice.token_ids.append(tok)
                if choice.logprobs is not None:
                    choice.logprobs.append(entry)
            if i == last and out.finish_reason == "stop" and not (out.stop_reason is not None
                                                                 and req.params.include_stop_str_in_output):
                break  # the core ended the choice on this token (EOS, or a stop id not asked for): not text
            found = choice.detokenizer.add_token(tok, may_stop=choice.num_tokens >= req.params.min_tokens)
            if found is not None:
                choice.finish_reason, choice.stop_reason = "stop", found
                return found
        if out.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason
        return None

    def _output(self, req: _Request, news: dict[int, _News], failed: CoreOutput | None) -> list[RequestOutput]:
        error, invalid = (failed.error, failed.invalid_request) if failed is not None else (None, False)
        if req.delta:
            outputs = [self._delta(req, i, item) for i, item in sorted(news.items())]
            prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None  # sent once, with the first delta
        else:
            for i, item in news.items():
                req.choices[i].pieces.append(item.text)
            if not req.finished:
                return []
            outputs, prompt_logprobs = [self._final(req, i) for i in range(len(req.choices))], req.prompt_logprobs
        token_times, req.token_times = req.token_times, []
        return [RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outputs, req.finished,
                              prompt_logprobs, req.num_cached_tokens, error, req.embedding, invalid,
                              req.arrival_time, token_times)]

    @staticmethod
    def _delta(req: _Request, index: int, item: _News) -> CompletionOutput:
        c = req.choices[index]
        wants = req.params.logprobs is not None
        return CompletionOutput(index, item.text, item.token_ids, c.cumulative_logprob if wants else None,
                                item.logprobs if wants else None, c.finish_reason, c.stop_reason)

    @staticmethod
    def _final(req: _Request, index: int) -> CompletionOutput:
        c = req.choices[index]
        wants = req.params.logprobs is not None
        return CompletionOutput(index, "".join(c.pieces), c.token_ids, c.cumulative_logprob if wants else None,
                                c.logprobs, c.finish_reason, c.stop_reason)
