"""POST /v1/chat/completions' request: messages (content parts, tool calls), tools and tool_choice, and the
chat-template fields /tokenize shares."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from engine.frontend import chat_template
from engine.sampling_params import SamplingParams
from server.protocol.fields import Logprobs, MaxTokens, _Request, _needs, _rules, _str_or_object, _unsupported
from server.protocol.sampling import STREAM_OPTIONS_RULE, _SamplingRequest


CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")  # developer: OpenAI's newer name for system


class ContentPart(BaseModel):
    # extra allowed, and the type any string, so that the check below gives the message; the
    # document says what is served.
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=lambda schema, _: schema.update(
        properties={"type": {"const": "text"}, "text": {"type": "string"}}, required=["type", "text"],
        additionalProperties=False))
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text":
            raise ValueError(f"content part type {self.type!r} is not supported yet: only 'text' parts")
        if self.text is None or self.model_extra:
            raise ValueError("a text content part is {\"type\": \"text\", \"text\": \"...\"}")
        return self


class CalledFunction(_Request):
    name: str
    arguments: str  # JSON text, as the API returned it


class MessageToolCall(_Request):
    """One of an assistant turn's calls, as the API returned it (`index`: a streamed delta's, kept
    by clients that assemble calls from deltas)."""

    function: CalledFunction
    id: str | None = None
    type: Literal["function"] = "function"
    index: int | None = None


def _message_schema(schema: dict) -> None:
    """The document's form of a message, one per role: what the validators below accept."""
    p = schema.pop("properties")
    text = {"anyOf": [m for m in p["content"]["anyOf"] if m.get("type") != "null"]}
    name = p["name"]

    def role(roles, required=(), **props):
        return {"type": "object", "additionalProperties": False, "required": ["role", *required],
                "properties": {"role": {"enum": list(roles)}, "name": name, **props}}

    turns = [role(("system", "developer", "user"), ["content"], content=text),
             role(("tool",), ["content", "tool_call_id"], content=text, tool_call_id={"type": "string",
                                                                                        "minLength": 1}),
             {**role(("assistant",), content=p["content"], tool_calls=p["tool_calls"],
                     reasoning_content=p["reasoning_content"], reasoning=p["reasoning"]),
              "anyOf": [{"required": ["content"], "properties": {"content": text}},
                        {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}}]}]
    for key in ("type", "required", "additionalProperties"):
        schema.pop(key, None)
    schema["oneOf"] = turns


class ChatMessage(_Request):
    model_config = ConfigDict(json_schema_extra=lambda schema, _: _message_schema(schema))
    role: Annotated[str, WithJsonSchema({"enum": list(CHAT_ROLES)})]
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn's calls, as the API returned them
    tool_call_id: str | None = None  # a tool turn: the call it answers
    # None only for an assistant turn that made tool calls (checked after the fields above).
    content: str | list[ContentPart] | None = Field(default=None, validate_default=True)
    name: str | None = None
    # An assistant turn's reasoning, as a reasoning parser returned it (under either name), sent back
    # so that templates that keep it (Qwen3's, GLM's, Kimi's read `reasoning_content`) can.
    reasoning_content: str | None = None
    reasoning: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role):
        if role == "function":
            raise ValueError("role 'function' is OpenAI's deprecated form: send role 'tool' with tool_call_id")
        if role not in CHAT_ROLES:
            raise ValueError(f"unknown role {role!r}: use one of system, user, assistant, tool")
        return role

    @field_validator("content")
    @classmethod
    def _content_or_calls(cls, v, info):
        if "tool_calls" not in info.data:
            return v  # tool_calls failed their own validation, which says what to change
        if v is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError("Field required (only an assistant turn with tool_calls may omit content)")
        return v

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant turns")
        if (self.reasoning_content is not None or self.reasoning is not None) and self.role != "assistant":
            raise ValueError("reasoning_content (or reasoning) belongs to assistant turns")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool turn needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def to_template(self) -> dict:
        """The turn as chat templates read it (transformers' convention: a call's arguments as an
        object, a tool turn's tool_call_id)."""
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            out["reasoning_content"] = out["reasoning"] = reasoning
        return out


def _without_field(check, *args) -> None:
    """Run an engine check whose ValueError starts with the field's name, inside a pydantic
    validator (which names the field itself)."""
    try:
        check(*args)
    except ValueError as e:
        raise ValueError(str(e).split(": ", 1)[-1]) from None


def _template_call(call: MessageToolCall) -> dict:
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        arguments = call.function.arguments  # left as the text it is
    return {"type": "function", "id": call.id, "function": {"name": call.function.name, "arguments": arguments}}


CONTINUE_RULE = _needs("continue_final_message", {"const": False}, "add_generation_prompt", {"const": False})


class _ChatTemplateFields(_Request):
    """vLLM's chat-template extras: render without the assistant's opening, leave the last message
    open for the model to continue (a prefilled start of the reply; the response holds only what
    follows it), and more variables for the template (e.g. Qwen3's enable_thinking)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    # The rules are engine.frontend.chat_template's; checked here too, so that a clash is a 400
    # naming its field before the prompt is rendered.
    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_open(cls, v, info):
        _without_field(chat_template.check_continue, info.data.get("add_generation_prompt", True), v)
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, v):
        _without_field(chat_template.check_template_kwargs, v)
        return v

    @property
    def template_options(self) -> dict:
        """The keyword arguments for PromptTokenizer.chat_prompt."""
        return dict(add_generation_prompt=self.add_generation_prompt,
                    continue_final_message=self.continue_final_message,
                    template_kwargs=self.chat_template_kwargs or {})


class FunctionDefinition(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (checked where its grammar is compiled)
    strict: bool | None = None


class Tool(_Request):
    """One function the model may call (OpenAI's `tools` entry)."""

    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    """tool_choice naming the one function to call."""

    type: Literal["function"]
    function: ToolChoiceFunction

    def __repr__(self) -> str:  # as the client wrote it, in messages that quote it
        return repr(self.model_dump())


ToolChoice = _str_or_object(Literal["none", "auto", "required"], NamedToolChoice,
                            "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")


class ChatCompletionRequest(_SamplingRequest, _ChatTemplateFields):
    model_config = ConfigDict(json_schema_extra=_rules(
        STREAM_OPTIONS_RULE, CONTINUE_RULE, _needs("top_logprobs", {"enum": [None, 0]}, "logprobs", {"const": True}),
        _needs("tool_choice", {"enum": [None, "none"]}, "tools", {"type": "array", "minItems": 1})))
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: MaxTokens | None = None  # None: up to the context window
    max_completion_tokens: MaxTokens | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: Logprobs | None = None  # at most the engine's max_logprobs
    # Tool calling (server/tool_calls.py checks them against the server's flags).
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's deprecated forms of the same: accepted only at their no-op values.
    functions: Annotated[list[Any] | None, WithJsonSchema({"anyOf": [{"type": "array", "maxItems": 0},
                                                                     {"type": "null"}]})] = None
    function_call: Annotated[Any, WithJsonSchema({"enum": ["none", None]})] = None

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, v, info):
        return _unsupported("functions (deprecated: send tools)", v, noop=(None, []))

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, v, info):
        return _unsupported("function_call (deprecated: send tool_choice)", v, noop=(None, "none"))

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, v, info):
        if v and not info.data.get("logprobs"):
            raise ValueError("requires logprobs to be true")
        return v

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int, defaults: dict) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, None, defaults)
