"""OpenAI request types (pydantic), and the request -> SamplingParams mapping (response bodies:
server/responses.py).

Requests are strict: a wrong type is an error, not a coercion ("5" is not 5), and any field
we do not implement is a 400 that names it, never silently dropped. Fields that exist in
OpenAI's API but that we do not support are accepted only at their no-op value
(`functions: []`, `suffix: ""`, ...).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, WithJsonSchema,
                      field_validator, model_validator)

from engine.frontend import chat_template
from engine.sampling_params import (MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_N, MIN_REPETITION_PENALTY,
                                    SEED_MAX, SEED_MIN, GrammarSpec, RequestError, SamplingParams)


def _integral_float(v: Any) -> Any:
    """1.0 is the integer 1 (JSON has one number type; OpenAI's API accepts it), 1.5 is not."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


# An integer field: strict (no "5", no true), except that an integral float counts.
Int = Annotated[int, BeforeValidator(_integral_float)]


def IntIn(ge: int | None = None, le: int | None = None):
    """Int within bounds (the bounds inside the validator, so that the document carries them)."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_integral_float)]


def FloatIn(ge: float | None = None, le: float | None = None, gt: float | None = None):
    return Annotated[float, Field(ge=ge, le=le, gt=gt)]


# Marks a bound in the document that the served engine sets (server/openapi.py fills it in): the
# largest token id, the longest output, the most logprobs.
SERVED_BOUND = "x-served-bound"


def IntUpTo(ge: int, bound: str):
    return Annotated[int, Field(ge=ge, json_schema_extra={SERVED_BOUND: bound}), BeforeValidator(_integral_float)]


TokenId = IntUpTo(0, "token_id")
MaxTokens = IntUpTo(1, "max_tokens")
Logprobs = IntUpTo(0, "logprobs")
NonEmpty = Annotated[str, Field(min_length=1)]
# logit_bias keys: ASCII digits only (str.isdecimal would take "²" and "①", which int() refuses).
LOGIT_BIAS_SCHEMA = {"anyOf": [{"type": "object", "additionalProperties": False, "patternProperties": {
    r"^[0-9]+$": {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS}}},
    {"type": "null"}]}


def _json_kind(v: Any) -> str | None:
    """The tag of a value's JSON type, for unions of a string form and an object form (the tags are
    errors.UNION_TAGS, which error paths leave out)."""
    if isinstance(v, str):
        return "str"
    if isinstance(v, (dict, BaseModel)):
        return "dict"
    return None


def _str_or_object(text: Any, obj: Any, message: str) -> Any:
    """A field that is one of a few strings or an object: one error naming the field for any other type."""
    return Annotated[Annotated[text, Tag("str")] | Annotated[obj, Tag("dict")],
                     Discriminator(_json_kind, custom_error_type="invalid_type", custom_error_message=message)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _needs(field: str, harmless: dict, other: str, needed: dict) -> dict:
    """For the document: `field` absent or harmless, or else `other` set as needed (a rule a
    validator below enforces across two fields)."""
    return {"anyOf": [{"properties": {field: harmless}}, {"required": [other], "properties": {other: needed}}]}


def _rules(*rules: dict):
    """json_schema_extra adding cross-field rules to a request's document."""
    return lambda schema, _: schema.setdefault("allOf", []).extend(rules)


class StreamOptions(_Request):
    include_usage: bool = False


def _unsupported(what: str, value: Any, noop: tuple = (None,)) -> Any:
    """Accept the field only at a value that changes nothing; otherwise say it is unsupported."""
    if value in noop:
        return value
    raise ValueError(f"{what} is not supported yet")


# The JSON schema of a completions `prompt` / embeddings `input` (checked by _prompt_shape).
_ID = {"type": "integer", "minimum": 0, SERVED_BOUND: "token_id"}
PROMPT_SCHEMA = {"anyOf": [{"type": "string", "minLength": 1},
                           {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                           {"type": "array", "items": _ID, "minItems": 1},
                           {"type": "array", "minItems": 1, "items": {"type": "array", "items": _ID, "minItems": 1}}]}
PromptField = Annotated[Any, WithJsonSchema(PROMPT_SCHEMA)]


def _prompt_shape(v):
    """A completions `prompt` or an embeddings `input`: one clear message for every wrong shape
    (token ids as integral floats are integers, as for every integer field)."""
    def ids(x):
        if isinstance(x, list) and all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in x):
            x = [_integral_float(t) for t in x]
            return x if all(isinstance(t, int) for t in x) else None
        return None

    if isinstance(v, str):
        return v
    if ids(v) is not None:
        return ids(v)
    if isinstance(v, list) and all(isinstance(p, str) for p in v):
        return v
    if isinstance(v, list) and all(ids(p) is not None for p in v):
        return [ids(p) for p in v]
    raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists")


class JSONSchemaFormat(_Request):
    """response_format's json_schema: the schema the output follows (`strict`: no extra properties)."""

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")  # OpenAI's key is `schema`
    strict: bool | None = None


def _format_schema(schema: dict) -> None:
    """For the document: json_schema given with type json_schema, and only then."""
    schema["oneOf"] = [{"properties": {"type": {"enum": ["text", "json_object"]}, "json_schema": {"type": "null"}}},
                       {"required": ["json_schema"], "properties": {"type": {"const": "json_schema"}, "json_schema": {
                           "type": "object"}}}]


class ResponseFormat(_Request):
    model_config = ConfigDict(json_schema_extra=lambda schema, _: _format_schema(schema))
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type json_schema, and only then: {'type': 'json_schema', "
                             "'json_schema': {'name': ..., 'schema': {...}}}")
        return self


class StructuredOutputs(_Request):
    """vLLM's structured_outputs: one constraint (engine.sampling_params.GRAMMAR_KINDS)."""

    model_config = ConfigDict(json_schema_extra={"maxProperties": 1})

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")  # a JSON schema, or its JSON text
    json_object: bool | None = None
    regex: NonEmpty | None = None
    choice: Annotated[list[NonEmpty], Field(min_length=1)] | None = None
    grammar: NonEmpty | None = None  # EBNF (GBNF)

    def constraints(self) -> list[tuple[str, Any]]:
        """(kind, value) of each constraint set (None and false set none)."""
        values = {"json": self.json_, "json_object": self.json_object or None, "regex": self.regex,
                  "choice": self.choice, "grammar": self.grammar}
        return [(kind, v) for kind, v in values.items() if v is not None]


def _logit_bias_keys(v: Any) -> Any:
    """Keys must read as token ids; each bias's range is checked with the dict, the vocabulary by
    the engine's limits."""
    if isinstance(v, dict):
        bad = [k for k in v if not (isinstance(k, str) and k.strip().isascii() and k.strip().isdigit())]
        if bad:
            raise ValueError(f"keys are token ids written as decimal strings of the digits 0-9 (e.g. \"50256\"), "
                             f"got {bad[0][:40]!r}")
    return v


class _SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions, plus the engine's extras. The
    ranges are SamplingParams' (which checks them for the engine's own callers too)."""

    model: str | None = None  # optional: this server serves one model
    temperature: FloatIn(0, 2) | None = None
    top_p: FloatIn(le=1, gt=0) | None = None
    n: IntIn(1, MAX_N) = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=16)] | None = None
    presence_penalty: FloatIn(-2, 2) | None = None
    frequency_penalty: FloatIn(-2, 2) | None = None
    seed: IntIn(SEED_MIN, SEED_MAX) | None = None
    user: str | None = None  # an end-user id for abuse tracking; recorded nowhere, changes nothing
    # OpenAI: token ids as JSON keys (strings), each bias in [-100, 100]
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None,
                          BeforeValidator(_logit_bias_keys), WithJsonSchema(LOGIT_BIAS_SCHEMA)] = None
    # Engine extras (vLLM names).
    top_k: IntIn(-1) | None = None
    min_p: FloatIn(0, 1) | None = None
    repetition_penalty: FloatIn(MIN_REPETITION_PENALTY, 10) | None = None
    min_tokens: IntIn(0) = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    allowed_token_ids: Annotated[list[TokenId] | None, Field(min_length=1)] = None
    bad_words: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]] | None,
                         Field(max_length=MAX_BAD_WORDS)] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_*.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: NonEmpty | None = None
    guided_choice: Annotated[list[NonEmpty], Field(min_length=1)] | None = None
    guided_grammar: NonEmpty | None = None

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v, info):
        if v is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return v

    @property
    def grammar_field(self) -> str:
        """The field this request's constraint came in (errors about it name that field)."""
        try:
            return self._grammar()[0] or "structured_outputs"
        except ValueError:  # reported, naming its field, when the sampling parameters are built
            return "structured_outputs"

    def _grammar(self) -> tuple[str | None, GrammarSpec | None]:
        """(field, constraint) from whichever of the structured-output fields is set; at most one."""
        found = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", GrammarSpec.of("json_object", None, field="response_format")))
        elif rf is not None and rf.type == "json_schema":
            js = rf.json_schema
            found.append(("response_format", GrammarSpec.of("json", js.json_schema, js.strict is not False,
                                                            field="response_format")))
        for kind, value in (self.structured_outputs.constraints() if self.structured_outputs else []):
            found.append(("structured_outputs", GrammarSpec.of(kind, value)))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                found.append((name, GrammarSpec.of(kind, getattr(self, name), field=name)))
        if len(found) > 1:
            raise RequestError(found[1][0], f": only one output constraint per request, and {found[0][0]} sets one too")
        return found[0] if found else (None, None)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
                         defaults: dict) -> SamplingParams:
        """Raises ValueError naming the field (SamplingParams is the one place values are checked).
        `defaults`: the model's sampling settings (SamplingDefaults.as_dict()), for the fields this
        request leaves unset."""
        kw = dict(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            structured_outputs=self._grammar()[1],
        )
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if getattr(self, name) is not None:  # None means "the model's default, else the API's"
                kw[name] = getattr(self, name)
            elif name in defaults:
                kw[name] = defaults[name]
        return SamplingParams(**kw)


# --------------------------------------------------------------------------- completions
STREAM_OPTIONS_RULE = _needs("stream_options", {"type": "null"}, "stream", {"const": True})


class CompletionRequest(_SamplingRequest):
    model_config = ConfigDict(json_schema_extra=_rules(STREAM_OPTIONS_RULE))
    prompt: PromptField  # str | list[str] | list[int] | list[list[int]], checked below for one clear message
    max_tokens: MaxTokens | None = 16  # OpenAI's default; null means "up to the context window"
    logprobs: Logprobs | None = None
    echo: bool = False
    suffix: Annotated[str | None, WithJsonSchema({"enum": ["", None]})] = None
    best_of: IntIn(1, MAX_N) | None = None  # only n

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        return _unsupported("insertion (suffix)", v, noop=(None, ""))

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, v):
        return _prompt_shape(v)

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v, info):
        if v is not None and v != info.data.get("n", 1):
            raise ValueError("values other than n are not supported yet")
        return v

    def to_sampling_params(self, max_tokens: int, defaults: dict) -> SamplingParams:
        # echo + logprobs reports the prompt's logprobs too, as OpenAI does
        prompt_logprobs = self.logprobs if (self.echo and self.logprobs is not None) else None
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs, defaults)


# --------------------------------------------------------------------------- chat
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


# --------------------------------------------------------------------------- tokenize / detokenize (vLLM's shapes)


def _tokenize_forms() -> dict:
    """For the document: a prompt (and no chat-template field), or messages."""
    template = {name: False for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")}
    return {"oneOf": [{"required": ["prompt"], "properties": {"prompt": {"type": "string"},
                                                              "messages": {"type": "null"}, **template}},
                      {"required": ["messages"], "properties": {"prompt": {"type": "null"},
                                                                "messages": {"type": "array", "minItems": 1}}}]}


class TokenizeRequest(_ChatTemplateFields):
    """Either a completions `prompt` (a string) or chat `messages`, tokenized as the generation
    routes would: the chat template applied to messages (with the assistant's opening when
    add_generation_prompt, the template options as chat's), special tokens added to a plain prompt
    unless add_special_tokens is false."""

    model_config = ConfigDict(json_schema_extra=_rules(_tokenize_forms(), CONTINUE_RULE))
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, validate_default=True)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template adds them)
    return_token_strs: bool = False

    @field_validator("messages")
    @classmethod
    def _prompt_or_messages(cls, v, info):
        if v is not None and not v:
            raise ValueError("must not be empty")
        if "prompt" in info.data and (info.data["prompt"] is None) == (v is None):  # (a bad prompt says so itself)
            raise ValueError("give exactly one of prompt and messages")
        return v

    @model_validator(mode="after")
    def _template_options_need_messages(self):
        template = sorted(self.model_fields_set & set(_ChatTemplateFields.model_fields))
        if self.prompt is not None and template:
            raise ValueError(f"{template[0]} applies to messages (the chat template), not to a prompt: remove it")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


# --------------------------------------------------------------------------- embeddings


class EmbeddingRequest(_Request):
    model: str | None = None
    input: PromptField  # str | list[str] | list[int] | list[list[int]], as a completions prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[Int | None, WithJsonSchema({"type": "null"})] = None
    user: str | None = None
    # Engine extra: how the final hidden states become one vector (both are L2-normalised).
    pooling: Literal["last", "mean"] = "last"

    @field_validator("input")
    @classmethod
    def _input_shape(cls, v):
        return _prompt_shape(v)

    @field_validator("dimensions")
    @classmethod
    def _no_dimensions(cls, v):
        return _unsupported("dimensions (the vector is the model's hidden size)", v)
