"""POST /v1/chat/completions: messages (and tools) -> chat template -> one engine request with n
choices; tool calls (server/tool_calls.py) come back as `tool_calls`, whole or streamed."""

from __future__ import annotations

import dataclasses
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.core.admission import resolve_max_tokens
from engine.outputs import RequestOutput
from engine.sampling_params import RequestError, SamplingParams
from server.logprobs import chat_logprobs
from server.openapi import route_docs
from server import tool_calls
from server.protocol import ChatCompletionRequest
from server.reasoning import CONTENT, REASONING, Reasoning, ReasoningParser, count_reasoning_tokens
from server.responses import (ChatChoice, ChatCompletionChunk, ChatCompletionResponse, ChatLogprobs,
                              ChatResponseMessage, ChatStreamChoice, CompletionTokensDetails, DeltaFunctionCall,
                              DeltaMessage, DeltaToolCall, FunctionCall, ToolCallOut, UsageInfo)
from server.routes.common import (engine_errors, error_event_body, new_id, read_request,
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
    renames = _renames(body, plan)
    defaults = state.engine.sampling_defaults
    with sampling_errors(renames=renames):
        max_tokens = resolve_max_tokens(len(prompt.token_ids), body.requested_max_tokens, state.max_model_len,
                                        defaults.max_tokens)
        params = body.to_sampling_params(max_tokens, defaults.as_dict())
        if plan.grammar is not None:
            if params.structured_outputs is not None:
                raise RequestError("tool_choice", f" {body.tool_choice!r} constrains the output itself: drop "
                                                  f"{body.grammar_field}, or use tool_choice 'auto' or 'none'")
            params = dataclasses.replace(params, structured_outputs=plan.grammar)
        params = _reply_params(state, body, plan, prompt.text, params)

    request_id = new_id("chatcmpl")
    lora = state.lora_request(body.model)
    stream = state.metrics.track(state.engine.generate(request_id, prompt.token_ids, params, prompt=prompt.text,
                                                       delta=body.stream, lora_request=lora), params.n, lora)
    render = _Renderer(state, body, request_id, plan, prompt.text)
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


def _reply_params(state: ServerState, body: ChatCompletionRequest, plan: tool_calls.Plan, prompt_text: str | None,
                  params: SamplingParams) -> SamplingParams:
    """The sampling parameters as the reply's parsers need them: a grammar that waits for the end of
    the reasoning, special tokens kept where a parser reads one (gpt-oss's channels, [TOOL_CALLS])."""
    if plan.special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    return _reasoning(state, body, prompt_text).sampling_params(params)


def _reasoning(state: ServerState, body: ChatCompletionRequest, prompt_text: str | None) -> Reasoning:
    """How this request's replies are read: the server's --reasoning-parser, with what the prompt and
    chat_template_kwargs (Qwen3's enable_thinking) say about thinking."""
    return Reasoning(state.tools.reasoning_parser, prompt_text, body.chat_template_kwargs or {})


@dataclasses.dataclass
class _ChoiceStream:
    """One streamed choice: its reasoning parser, and in a tool mode its answer so far and what went out."""

    parser: ReasoningParser | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)  # kept to count the reasoning's tokens
    text: str = ""  # the answer so far (tool modes)
    sent: int = 0  # how much of it went out as content ("auto")
    called: bool = False  # a tool call went out
    args_sent: list[int] = dataclasses.field(default_factory=list)  # per streamed call: arguments text sent


class _Renderer:
    """Engine outputs -> chat.completion responses and chat.completion.chunk deltas. With a reasoning
    parser a choice's text is split first: the reasoning goes to reasoning_content, and the answer
    is what the tool modes read."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest, request_id: str, plan: tool_calls.Plan,
                 prompt_text: str | None = None):
        self.state, self.body, self.id, self.plan = state, body, request_id, plan
        self.parser = state.tools.parser
        self.reasoning = _reasoning(state, body, prompt_text)
        self.created = int(time.time())
        self.model = state.model_name(body.model)

    def _logprobs(self, ids: list[int], positions) -> ChatLogprobs | None:
        if not self.body.logprobs:
            return None
        return ChatLogprobs(content=chat_logprobs(ids, positions or [{}] * len(ids), self.state.token_texts,
                                                  self.body.top_logprobs or 0))

    def _usage(self, prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None) -> UsageInfo:
        details = None if reasoning_tokens is None else CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens, completion_tokens_details=details)

    def _reasoning_tokens(self, parser: ReasoningParser, token_ids: list[int]) -> int:
        skip = self.body.skip_special_tokens and not parser.needs_special_tokens
        return count_reasoning_tokens(token_ids, parser.content_offset,
                                      lambda ids: self.state.tokenizer.decode(ids, skip_special_tokens=skip))

    @staticmethod
    def _finish(called: bool, reason: str | None) -> str | None:
        """OpenAI's finish_reason: "tool_calls" for a choice that ended by making calls."""
        return "tool_calls" if called and reason == "stop" else reason

    def response(self, output: RequestOutput) -> ChatCompletionResponse:
        choices, reasoning_tokens = [], None
        for c in output.outputs:
            parser = self.reasoning.new_parser()
            reasoning, answer = (None, c.text) if parser is None else parser.split(c.text)
            content, calls = tool_calls.calls_from_text(self.plan, answer or "", self.parser)
            if answer is None and not calls:
                content = None  # the reply was all reasoning
            if parser is not None:
                reasoning_tokens = (reasoning_tokens or 0) + self._reasoning_tokens(parser, c.token_ids)
            message = ChatResponseMessage(content=content, reasoning_content=reasoning, tool_calls=[
                ToolCallOut(id=t.id, function=FunctionCall(name=t.name, arguments=t.arguments)) for t in calls])
            choices.append(ChatChoice(index=c.index, message=message, logprobs=self._logprobs(c.token_ids, c.logprobs),
                                      finish_reason=self._finish(bool(calls), c.finish_reason),
                                      stop_reason=c.stop_reason,
                                      token_ids=list(c.token_ids) if self.body.return_token_ids else None))
        usage = self._usage(len(output.prompt_token_ids), sum(len(c.token_ids) for c in output.outputs),
                            reasoning_tokens)
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=usage, prompt_token_ids=(list(output.prompt_token_ids)
                                                                     if self.body.return_token_ids else None))

    def _deltas(self, c, st: _ChoiceStream):
        """The DeltaMessages for this piece of a choice's text: its reasoning, then its answer as
        content or, in a tool mode, as tool-call deltas."""
        finished = c.finish_reason is not None
        if st.parser is None:
            pieces = [(CONTENT, c.text)]
        else:
            pieces = st.parser.feed(c.text) + (st.parser.finish() if finished else [])
        for kind, text in pieces:
            if kind == REASONING:
                yield DeltaMessage(reasoning_content=text)
            elif self.plan.mode == "none":
                if text:
                    yield DeltaMessage(content=text)
            else:
                yield from self._tool_deltas(text, st)
        if finished and self.plan.mode != "none":
            yield from self._tool_deltas("", st, finished=True)

    def _tool_deltas(self, text: str, st: _ChoiceStream, finished: bool = False):
        """The DeltaMessages for this piece of a choice's answer in a tool mode."""
        st.text += text
        if self.plan.mode == "named":
            if not st.called:
                st.called = True
                call = tool_calls.ToolCall(self.plan.name, "", tool_calls.call_id(self.parser))
                yield DeltaMessage(tool_calls=[DeltaToolCall(index=0, id=call.id, type="function",
                                                             function=DeltaFunctionCall(name=call.name, arguments=""))])
            if text:
                yield DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))])
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
                yield DeltaMessage(tool_calls=[DeltaToolCall(index=i, id=tool_calls.call_id(self.parser),
                                                             type="function",
                                                             function=DeltaFunctionCall(name=call.name, arguments=""))])
            if len(call.arguments) > st.args_sent[i]:
                yield DeltaMessage(tool_calls=[DeltaToolCall(index=i, function=DeltaFunctionCall(
                    arguments=call.arguments[st.args_sent[i]:]))])
                st.args_sent[i] = len(call.arguments)
        if not finished:
            return
        _, calls = tool_calls.calls_from_text(self.plan, st.text, self.parser)
        if calls[len(st.args_sent):]:  # calls the scanner could not follow (arguments before the name): whole
            st.called = True
            yield DeltaMessage(tool_calls=[DeltaToolCall(index=i, id=t.id, type="function",
                                                         function=DeltaFunctionCall(name=t.name, arguments=t.arguments))
                                           for i, t in enumerate(calls) if i >= len(st.args_sent)])
        elif not st.called and len(st.text) > st.sent:  # no call after all: the held-back text is content
            yield DeltaMessage(content=st.text[st.sent:])

    def _chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None,
               prompt_token_ids: list[int] | None = None) -> str:
        return event(ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                         usage=usage, prompt_token_ids=prompt_token_ids))

    async def events(self, stream):
        """Each delta as chunks: the role first, then reasoning_content (with a reasoning parser),
        then content (and logprobs) or tool-call deltas, then finish_reason. Calls stream as they
        are generated: each call's id and name once its name is complete, then its arguments' text
        piece by piece; with "auto", content streams until what may be a call's start."""
        choices: dict[int, _ChoiceStream] = {}  # each choice's parser and tool-mode state, from its first delta
        prompt_tokens = completion_tokens = 0
        try:
            async for output in stream:
                prompt_tokens = len(output.prompt_token_ids)
                for c in output.outputs:
                    completion_tokens += len(c.token_ids)
                    if c.index not in choices:
                        choices[c.index] = _ChoiceStream(parser=self.reasoning.new_parser())
                        prompt_ids = list(output.prompt_token_ids) if self.body.return_token_ids else None
                        yield self._chunk([ChatStreamChoice(index=c.index,
                                                            delta=DeltaMessage(role="assistant", content=""))],
                                          prompt_token_ids=prompt_ids)
                    st = choices[c.index]
                    st.token_ids += c.token_ids
                    logprobs = self._logprobs(c.token_ids, c.logprobs) if self.plan.mode == "none" else None
                    ids = list(c.token_ids) if self.body.return_token_ids and c.token_ids else None
                    deltas = list(self._deltas(c, st))
                    if not deltas and (logprobs is not None or ids) and c.token_ids:
                        deltas = [DeltaMessage(content="")]  # text held back: the logprobs and ids go out now
                    for i, delta in enumerate(deltas):
                        yield self._chunk([ChatStreamChoice(index=c.index, delta=delta,
                                                            logprobs=logprobs if i == 0 else None,
                                                            token_ids=ids if i == 0 else None)])
                    if c.finish_reason is not None:  # the last chunk of a choice carries finish_reason
                        yield self._chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(),
                                                            finish_reason=self._finish(st.called, c.finish_reason),
                                                            stop_reason=c.stop_reason)])
            if self.body.include_usage:
                reasoning_tokens = None
                if self.reasoning.parser is not None:
                    reasoning_tokens = sum(self._reasoning_tokens(st.parser, st.token_ids) for st in choices.values())
                yield self._chunk([], usage=self._usage(prompt_tokens, completion_tokens, reasoning_tokens))
        except Exception as e:  # the engine died mid-stream: tell the client inside the stream
            yield event(error_event_body(e, _renames(self.body, self.plan)))
        finally:
            await stream.aclose()
        yield DONE
