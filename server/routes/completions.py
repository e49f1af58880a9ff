"""POST /v1/completions: one engine request per prompt, n choices each (choice index = prompt * n + choice)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.core.admission import resolve_max_tokens
from engine.outputs import RequestOutput
from server.logprobs import completion_logprobs
from server.openapi import route_docs
from server.prompts import Prompt, prompt_items
from server.protocol import CompletionRequest
from server.responses import CompletionChoice, CompletionResponse, UsageInfo
from server.routes.common import engine_errors, error_event_body, new_id, read_request, sampling_errors
from server.sse import DONE, event, sse_response
from server.state import ServerState
from server.streams import ClientDisconnected, last_outputs, merge, primed_all, unless_disconnected

router = APIRouter()


@router.post("/v1/completions", **route_docs(CompletionRequest, CompletionResponse))
async def create_completion(request: Request):
    state, body = await read_request(request, CompletionRequest)
    state.check_admissible(len(prompt_items(body.prompt)), body.n)
    prompts = await state.prompts.completion_prompts(body.prompt)
    params = []
    defaults = state.engine.sampling_defaults
    unset = defaults.as_dict()  # what the model sets for the fields a request leaves unset
    with sampling_errors(renames=_renames(body)):
        for p in prompts:
            max_tokens = resolve_max_tokens(len(p.token_ids), body.max_tokens, state.max_model_len, defaults.max_tokens)
            params.append(body.to_sampling_params(max_tokens, unset))

    request_id = new_id("cmpl")
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    lora = state.lora_request(body.model)
    streams = [state.metrics.track(state.engine.generate(rid, p.token_ids, sp, prompt=p.text, delta=body.stream,
                                                         lora_request=lora), sp.n, lora)
               for rid, p, sp in zip(ids, prompts, params)]
    render = _Renderer(state, body, prompts, request_id)
    try:
        with engine_errors(_renames(body)):
            streams = await unless_disconnected(request, primed_all(streams))
            if body.stream:
                return sse_response(render.events(streams))
            finals = await unless_disconnected(request, last_outputs(streams))
    except ClientDisconnected:
        return Response(status_code=499)  # nobody is listening; the requests were aborted
    return Response(render.response(finals).model_dump_json(), media_type="application/json")


def _renames(body: CompletionRequest) -> dict[str, str]:
    """The engine's field names -> the ones this request sent (its errors name those)."""
    return {"structured_outputs": body.grammar_field}


class _Renderer:
    """Engine outputs (cumulative) -> OpenAI completion responses and stream chunks (deltas)."""

    def __init__(self, state: ServerState, body: CompletionRequest, prompts: list[Prompt], request_id: str):
        self.state, self.body, self.prompts, self.id = state, body, prompts, request_id
        self.created = int(time.time())
        self.model = state.model_name(body.model)

    def _prompt_text(self, i: int) -> str:
        p = self.prompts[i]
        return p.text if p.text is not None else self.state.tokenizer.decode(p.token_ids)

    def _echo_logprobs(self, i: int, prompt_logprobs):
        """The prompt's tokens and logprobs, for echo=True with logprobs."""
        ids = self.prompts[i].token_ids
        return completion_logprobs(ids, prompt_logprobs or [None] * len(ids), self.state.token_texts)

    def _choice(self, i: int, c, text: str, text_offset: int, echo: bool, prompt_logprobs,
                first: bool = True) -> CompletionChoice:
        """One choice (whole, or the delta of a stream chunk: `first` for a choice's first) in OpenAI's
        completion shape."""
        logprobs = None
        if self.body.logprobs is not None:
            ids = c.token_ids
            logprobs = completion_logprobs(ids, c.logprobs or [None] * len(ids), self.state.token_texts, text_offset)
            if echo:
                head = self._echo_logprobs(i, prompt_logprobs)
                shift = head.text_offset[-1] + len(head.tokens[-1]) if head.tokens else 0
                logprobs.text_offset = [o + shift for o in logprobs.text_offset]
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    setattr(logprobs, name, getattr(head, name) + getattr(logprobs, name))
        ids = {}
        if self.body.return_token_ids:
            ids = dict(token_ids=list(c.token_ids), prompt_token_ids=self.prompts[i].token_ids if first else None)
        return CompletionChoice(index=i * self.body.n + c.index, text=text, logprobs=logprobs,
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason, **ids)

    def _usage(self, completion_tokens: int) -> UsageInfo:
        prompt = sum(len(p.token_ids) for p in self.prompts)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion_tokens,
                         total_tokens=prompt + completion_tokens)

    def response(self, finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for i, output in enumerate(finals):
            echo = self._prompt_text(i) if self.body.echo else ""
            for c in output.outputs:
                choices.append(self._choice(i, c, echo + c.text, 0, self.body.echo, output.prompt_logprobs))
        completion_tokens = sum(len(c.token_ids) for o in finals for c in o.outputs)
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                  usage=self._usage(completion_tokens))

    async def events(self, streams):
        """Each delta as a chunk; the work per chunk is that of its new text and tokens."""
        # choice index -> where its next token's text starts (the next text_offset: the token texts
        # before it, as a whole response counts them, not the text sent, which holds some back)
        next_offset: dict[int, int] = {}
        prompt_logprobs: dict[int, list] = {}  # prompt -> its logprobs, for echo (with the first delta)
        completion_tokens = 0
        merged = merge(streams)
        try:
            async for i, output in merged:
                if output.prompt_logprobs is not None:
                    prompt_logprobs[i] = output.prompt_logprobs
                for c in output.outputs:
                    idx = i * self.body.n + c.index
                    completion_tokens += len(c.token_ids)
                    first = idx not in next_offset
                    echo = self.body.echo and first
                    # Tokens whose text is still held back (a partial character or stop string)
                    # send nothing yet, unless the client wants their logprobs or ids now.
                    if not (c.text or echo or c.finish_reason or (c.token_ids and (
                            self.body.logprobs is not None or self.body.return_token_ids))):
                        continue
                    text = (self._prompt_text(i) if echo else "") + c.text
                    choice = self._choice(i, c, text, next_offset.get(idx, 0), echo, prompt_logprobs.get(i), first)
                    yield event(_chunk(self, [choice]))
                    lp = choice.logprobs
                    next_offset[idx] = (lp.text_offset[-1] + len(lp.tokens[-1]) if lp is not None and lp.tokens
                                        else next_offset.get(idx, 0))
            if self.body.include_usage:
                yield event(_chunk(self, [], usage=self._usage(completion_tokens)))
        except Exception as e:  # the engine died mid-stream: tell the client inside the stream
            yield event(error_event_body(e, _renames(self.body)))
        finally:
            await merged.aclose()
        yield DONE


def _chunk(render: _Renderer, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> CompletionResponse:
    return CompletionResponse(id=render.id, created=render.created, model=render.model, choices=choices, usage=usage)
