"""POST /v1/completions: one engine request per prompt, n choices each (choice index = prompt * n + choice)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.outputs import RequestOutput
from server.logprobs import completion_logprobs
from server.openapi import route_docs
from server.prompts import Prompt, prompt_items, resolve_max_tokens
from server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo
from server.routes.common import engine_errors, error_event_body, new_id, parse_body, sampling_errors
from server.sse import DONE, event, sse_response
from server.state import ServerState, get_state
from server.streams import ClientDisconnected, last_outputs, merge, primed_all, unless_disconnected

router = APIRouter()


@router.post("/v1/completions", **route_docs(CompletionRequest, CompletionResponse))
async def create_completion(request: Request):
    state = get_state(request)
    body: CompletionRequest = parse_body(CompletionRequest, await request.body())
    state.check_model(body.model)
    state.check_admissible(len(prompt_items(body.prompt)), body.n)
    prompts = await state.prompts.completion_prompts(body.prompt)
    params = []
    for p in prompts:
        max_tokens = resolve_max_tokens(len(p.token_ids), body.max_tokens, state.max_model_len)
        with engine_errors(), sampling_errors():
            params.append(body.to_sampling_params(max_tokens))
            state.engine.check_request(p.token_ids, params[-1])

    request_id = new_id("cmpl")
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    streams = [state.metrics.track(state.engine.generate(rid, p.token_ids, sp, prompt=p.text), sp.n)
               for rid, p, sp in zip(ids, prompts, params)]
    render = _Renderer(state, body, prompts, request_id)
    try:
        with engine_errors():
            streams = await unless_disconnected(request, primed_all(streams))
            if body.stream:
                return sse_response(render.events(streams))
            finals = await unless_disconnected(request, last_outputs(streams))
    except ClientDisconnected:
        return Response(status_code=499)  # nobody is listening; the requests were aborted
    return Response(render.response(finals).model_dump_json(), media_type="application/json")


class _Renderer:
    """Engine outputs (cumulative) -> OpenAI completion responses and stream chunks (deltas)."""

    def __init__(self, state: ServerState, body: CompletionRequest, prompts: list[Prompt], request_id: str):
        self.state, self.body, self.prompts, self.id = state, body, prompts, request_id
        self.created = int(time.time())
        self.model = state.served_model_name

    def _prompt_text(self, i: int) -> str:
        p = self.prompts[i]
        return p.text if p.text is not None else self.state.tokenizer.decode(p.token_ids)

    def _echo_logprobs(self, i: int, output: RequestOutput):
        """The prompt's tokens and logprobs, for echo=True with logprobs."""
        ids = output.prompt_token_ids
        positions = output.prompt_logprobs or [None] * len(ids)
        return completion_logprobs(ids, positions, self.state.token_texts)

    def _choice(self, i: int, c, text: str, ids: list[int], positions, text_offset: int,
                echo_output: RequestOutput | None) -> CompletionChoice:
        logprobs = None
        if self.body.logprobs is not None:
            logprobs = completion_logprobs(ids, positions or [None] * len(ids), self.state.token_texts, text_offset)
            if echo_output is not None:
                head = self._echo_logprobs(i, echo_output)
                shift = head.text_offset[-1] + len(head.tokens[-1]) if head.tokens else 0
                logprobs.text_offset = [o + shift for o in logprobs.text_offset]
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    setattr(logprobs, name, getattr(head, name) + getattr(logprobs, name))
        return CompletionChoice(index=i * self.body.n + c.index, text=text, logprobs=logprobs,
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)

    def _usage(self, finals: dict[int, RequestOutput]) -> UsageInfo:
        prompt = sum(len(p.token_ids) for p in self.prompts)
        completion = sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def response(self, finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for i, output in enumerate(finals):
            echo = self._prompt_text(i) if self.body.echo else ""
            for c in output.outputs:
                choices.append(self._choice(i, c, echo + c.text, c.token_ids, c.logprobs, 0,
                                            output if self.body.echo else None))
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                  usage=self._usage(dict(enumerate(finals))))

    async def events(self, streams):
        sent_text: dict[int, int] = {}  # choice index -> characters sent
        sent_tokens: dict[int, int] = {}  # choice index -> tokens sent
        finals: dict[int, RequestOutput] = {}
        merged = merge(streams)
        try:
            async for i, output in merged:
                for c in output.outputs:
                    idx = i * self.body.n + c.index
                    n_chars, n_tokens = sent_text.get(idx, 0), sent_tokens.get(idx, 0)
                    if n_tokens < 0:
                        continue  # this choice already sent its finish_reason
                    echo = self._prompt_text(i) if (idx not in sent_tokens and self.body.echo) else ""
                    new_text, new_ids = c.text[n_chars:], c.token_ids[n_tokens:]
                    # Tokens whose text is still held back (a partial character or stop string)
                    # wait for the next chunk, unless the client wants their logprobs now.
                    wanted = new_text or echo or c.finish_reason or (new_ids and self.body.logprobs is not None)
                    if not wanted:
                        continue
                    positions = c.logprobs[n_tokens:len(c.token_ids)] if c.logprobs else None
                    choice = self._choice(i, c, echo + new_text, new_ids, positions, n_chars,
                                          output if echo else None)
                    sent_text[idx] = len(c.text)
                    sent_tokens[idx] = -1 if c.finish_reason else len(c.token_ids)
                    yield event(_chunk(self, [choice]))
                if output.finished:
                    finals[i] = output
            if self.body.include_usage:
                yield event(_chunk(self, [], usage=self._usage(finals)))
        except Exception as e:  # the engine died mid-stream: tell the client inside the stream
            yield event(error_event_body(e))
        finally:
            await merged.aclose()
        yield DONE


def _chunk(render: _Renderer, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> CompletionResponse:
    return CompletionResponse(id=render.id, created=render.created, model=render.model, choices=choices, usage=usage)
