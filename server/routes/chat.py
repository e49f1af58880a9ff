"""POST /v1/chat/completions: messages (and tools) -> chat template -> one engine request with n
choices; tool calls (server/tool_calls.py) come back as `tool_calls`, whole or streamed."""

from __future__ import annotations

import dataclasses
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.outputs import RequestOutput
from engine.sampling_params import RequestError
from server.logprobs import chat_logprobs
from server.openapi import route_docs
from server.prompts import resolve_max_tokens
from server import tool_calls
from server.protocol import ChatCompletionRequest
from server.responses import (ChatChoice, ChatCompletionChunk, ChatCompletionResponse, ChatLogprobs,
                              ChatResponseMessage, ChatStreamChoice, DeltaFunctionCall, DeltaMessage, DeltaToolCall,
                              FunctionCall, ToolCallOut, UsageInfo)
from server.routes.common import (check_request, engine_errors, error_event_body, new_id, read_request,
                                  sampling_errors)
from server.sse import DONE, event, sse_response
from server.state import ServerState
from server.streams import ClientDisconnected, last_outputs, primed_all, unless_disconnected

router = APIRouter()


@router.post("/v1/chat/completions", **route_docs(ChatCompletionRequest, ChatCompletionResponse))
async def create_chat_completion(request: Request):
    state, body = await read_request(request, ChatCompletionRequest)
    state.check_admissible(1, body.n)
    with sampling_errors():
        plan = tool_calls.plan(body.tools, body.tool_choice, body.parallel_tool_calls, state.tools)
    prompt = await state.prompts.chat_prompt([m.to_template() for m in body.messages], tools=body.tools,
                                             **body.template_options)
    max_tokens = resolve_max_tokens(len(prompt.token_ids), body.requested_max_tokens, state.max_model_len,
                                    field=body.max_tokens_field, prompt_field="messages")
    renames = _renames(body, plan)
    with engine_errors(renames), sampling_errors(renames=renames):
        params = body.to_sampling_params(max_tokens)
        if plan.grammar is not None:
            if params.structured_outputs is not None:
                raise RequestError("tool_choice", f" {body.tool_choice!r} constrains the output itself: drop "
                                                  f"{body.grammar_field}, or use tool_choice 'auto' or 'none'")
            params = dataclasses.replace(params, structured_outputs=plan.grammar)
        await check_request(state, prompt.token_ids, params)

    request_id = new_id("chatcmpl")
    stream = state.metrics.track(state.engine.generate(request_id, prompt.token_ids, params, prompt=prompt.text),
                                 params.n)
    render = _Renderer(state, body, request_id, plan)
    try:
        with engine_errors(renames):
            (stream,) = await unless_disconnected(request, primed_all([stream]))
            if body.stream:
                return sse_response(render.events(stream))
            (final,) = await unless_disconnected(request, last_outputs([stream]))
    except ClientDisconnected:
        return Response(status_code=499)  # nobody is listening; the request was aborted
    return Response(render.response(final).model_dump_json(), media_type="application/json")


def _renames(body: ChatCompletionRequest, plan: tool_calls.Plan) -> dict[str, str]:
    """The engine's field names -> the ones this request sent (its errors name those)."""
    return {"max_tokens": body.max_tokens_field, "logprobs": "top_logprobs", "prompt": "messages",
            "structured_outputs": "tools" if plan.grammar else body.grammar_field}


@dataclasses.dataclass
class _ToolStream:
    text: str = ""  # the choice's text so far
    sent: int = 0  # how much of it went out as content ("auto")
    called: bool = False  # a tool call went out
    args_sent: list[int] = dataclasses.field(default_factory=list)  # per streamed call: arguments text sent


class _Renderer:
    """Engine outputs (cumulative) -> chat.completion responses and chat.completion.chunk deltas."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest, request_id: str, plan: tool_calls.Plan):
        self.state, self.body, self.id, self.plan = state, body, request_id, plan
        self.parser = state.tools.parser
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

    @staticmethod
    def _finish(called: bool, reason: str | None) -> str | None:
        """OpenAI's finish_reason: "tool_calls" for a choice that ended by making calls."""
        return "tool_calls" if called and reason == "stop" else reason

    def response(self, output: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for c in output.outputs:
            content, calls = tool_calls.calls_from_text(self.plan, c.text, self.parser)
            message = ChatResponseMessage(content=content, tool_calls=[
                ToolCallOut(id=t.id, function=FunctionCall(name=t.name, arguments=t.arguments)) for t in calls])
            choices.append(ChatChoice(index=c.index, message=message, logprobs=self._logprobs(c.token_ids, c.logprobs),
                                      finish_reason=self._finish(bool(calls), c.finish_reason),
                                      stop_reason=c.stop_reason))
        usage = self._usage(len(output.prompt_token_ids), sum(len(c.token_ids) for c in output.outputs))
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=usage)

    def _tool_deltas(self, c, st: _ToolStream):
        """The DeltaMessages for this piece of a choice's text in a tool mode."""
        st.text += c.text
        if self.plan.mode == "named":
            if not st.called:
                st.called = True
                call = tool_calls.ToolCall(self.plan.name, "")
                yield DeltaMessage(tool_calls=[DeltaToolCall(index=0, id=call.id, type="function",
                                                             function=DeltaFunctionCall(name=call.name, arguments=""))])
            if c.text:
                yield DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=c.text))])
            return
        if self.plan.mode == "auto":  # content up to what may start a call
            safe = tool_calls.may_start_call(self.parser, st.text)
            if safe > st.sent:
                yield DeltaMessage(content=st.text[st.sent:safe])
                st.sent = safe
        for i, call in enumerate(tool_calls.partial_calls(self.plan.mode, self.parser, st.text)):
            if i == len(st.args_sent):  # its name is complete: the call's first delta
                st.called = True
                st.args_sent.append(0)
                yield DeltaMessage(tool_calls=[DeltaToolCall(index=i, id=tool_calls.ToolCall(call.name, "").id,
                                                             type="function",
                                                             function=DeltaFunctionCall(name=call.name, arguments=""))])
            if len(call.arguments) > st.args_sent[i]:
                yield DeltaMessage(tool_calls=[DeltaToolCall(index=i, function=DeltaFunctionCall(
                    arguments=call.arguments[st.args_sent[i]:]))])
                st.args_sent[i] = len(call.arguments)
        if c.finish_reason is None:
            return
        _, calls = tool_calls.calls_from_text(self.plan, st.text, self.parser)
        if calls[len(st.args_sent):]:  # calls the scanner could not follow (arguments before the name): whole
            st.called = True
            yield DeltaMessage(tool_calls=[DeltaToolCall(index=i, id=t.id, type="function",
                                                         function=DeltaFunctionCall(name=t.name, arguments=t.arguments))
                                           for i, t in enumerate(calls) if i >= len(st.args_sent)])
        elif not st.called and len(st.text) > st.sent:  # no call after all: the held-back text is content
            yield DeltaMessage(content=st.text[st.sent:])

    def _chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        return event(ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                         usage=usage))

    async def events(self, stream):
        """Each delta as chunks: the role first, then content (and logprobs) or tool-call deltas,
        then finish_reason. Calls stream as they are generated: each call's id and name once its
        name is complete, then its arguments' text piece by piece; with "auto", content streams
        until what may be a call's start."""
        started: set[int] = set()  # choices whose role chunk went out
        tools: dict[int, _ToolStream] = {}  # tool modes: each choice's text and what went out
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
                    if self.plan.mode == "none":
                        if c.text or (c.token_ids and self.body.logprobs):
                            yield self._chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(content=c.text),
                                                                logprobs=self._logprobs(c.token_ids, c.logprobs))])
                        called = False
                    else:
                        st = tools.setdefault(c.index, _ToolStream())
                        for delta in self._tool_deltas(c, st):
                            yield self._chunk([ChatStreamChoice(index=c.index, delta=delta)])
                        called = st.called
                    if c.finish_reason is not None:  # the last chunk of a choice carries finish_reason
                        yield self._chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(),
                                                            finish_reason=self._finish(called, c.finish_reason),
                                                            stop_reason=c.stop_reason)])
            if self.body.include_usage:
                yield self._chunk([], usage=self._usage(prompt_tokens, completion_tokens))
        except Exception as e:  # the engine died mid-stream: tell the client inside the stream
            yield event(error_event_body(e, _renames(self.body, self.plan)))
        finally:
            await stream.aclose()
        yield DONE
