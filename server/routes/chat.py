"""POST /v1/chat/completions: messages -> chat template -> one engine request with n choices."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.outputs import RequestOutput
from server.logprobs import chat_logprobs
from server.openapi import route_docs
from server.prompts import resolve_max_tokens
from server.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                             ChatLogprobs, ChatResponseMessage, ChatStreamChoice, DeltaMessage, UsageInfo)
from server.routes.common import engine_errors, error_event_body, new_id, parse_body, sampling_errors
from server.sse import DONE, event, sse_response
from server.state import ServerState, get_state
from server.streams import ClientDisconnected, last_outputs, primed_all, unless_disconnected

router = APIRouter()


@router.post("/v1/chat/completions", **route_docs(ChatCompletionRequest, ChatCompletionResponse))
async def create_chat_completion(request: Request):
    state = get_state(request)
    body: ChatCompletionRequest = parse_body(ChatCompletionRequest, await request.body())
    state.check_model(body.model)
    state.check_admissible(1, body.n)
    prompt = await state.prompts.chat_prompt([m.to_template() for m in body.messages])
    max_tokens = resolve_max_tokens(len(prompt.token_ids), body.requested_max_tokens, state.max_model_len,
                                    field=body.max_tokens_field, prompt_field="messages")
    renames = {"max_tokens": body.max_tokens_field, "logprobs": "top_logprobs", "prompt": "messages",
               "structured_outputs": body.grammar_field}
    with engine_errors(), sampling_errors(renames=renames):
        params = body.to_sampling_params(max_tokens)
        state.engine.check_request(prompt.token_ids, params)

    request_id = new_id("chatcmpl")
    stream = state.metrics.track(state.engine.generate(request_id, prompt.token_ids, params, prompt=prompt.text),
                                 params.n)
    render = _Renderer(state, body, request_id)
    try:
        with engine_errors():
            (stream,) = await unless_disconnected(request, primed_all([stream]))
            if body.stream:
                return sse_response(render.events(stream))
            (final,) = await unless_disconnected(request, last_outputs([stream]))
    except ClientDisconnected:
        return Response(status_code=499)  # nobody is listening; the request was aborted
    return Response(render.response(final).model_dump_json(), media_type="application/json")


class _Renderer:
    """Engine outputs (cumulative) -> chat.completion responses and chat.completion.chunk deltas."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest, request_id: str):
        self.state, self.body, self.id = state, body, request_id
        self.created = int(time.time())
        self.model = state.served_model_name

    def _logprobs(self, ids: list[int], positions) -> ChatLogprobs | None:
        if not self.body.logprobs:
            return None
        return ChatLogprobs(content=chat_logprobs(ids, positions or [{}] * len(ids), self.state.token_texts,
                                                  self.body.top_logprobs or 0))

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens)

    def response(self, output: RequestOutput) -> ChatCompletionResponse:
        choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                              logprobs=self._logprobs(c.token_ids, c.logprobs),
                              finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                   for c in output.outputs]
        usage = self._usage(len(output.prompt_token_ids), sum(len(c.token_ids) for c in output.outputs))
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=usage)

    def _chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        return event(ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                         usage=usage))

    async def events(self, stream):
        """Each delta as chunks: the role first, then content (and logprobs), then finish_reason."""
        started: set[int] = set()  # choices whose role chunk went out
        prompt_tokens = completion_tokens = 0
        try:
            async for output in stream:
                prompt_tokens = len(output.prompt_token_ids)
                for c in output.outputs:
                    completion_tokens += len(c.token_ids)
                    if c.index not in started:
                        started.add(c.index)
                        yield self._chunk([ChatStreamChoice(index=c.index,
                                                            delta=DeltaMessage(role="assistant", content=""))])
                    if c.text or (c.token_ids and self.body.logprobs):
                        yield self._chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(content=c.text),
                                                            logprobs=self._logprobs(c.token_ids, c.logprobs))])
                    if c.finish_reason is not None:  # the last chunk of a choice carries finish_reason
                        yield self._chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(),
                                                            finish_reason=c.finish_reason,
                                                            stop_reason=c.stop_reason)])
            if self.body.include_usage:
                yield self._chunk([], usage=self._usage(prompt_tokens, completion_tokens))
        except Exception as e:  # the engine died mid-stream: tell the client inside the stream
            yield event(error_event_body(e))
        finally:
            await stream.aclose()
        yield DONE
