"""OpenAI response bodies (pydantic): what the routes return, in OpenAI's shapes (and vLLM's for
/tokenize, /detokenize). Requests and their mapping onto SamplingParams are server/protocol/'s."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_serializer


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # the completion tokens that spelled the reasoning (its tags included)


def _without_none(data: dict, *keys: str) -> dict:
    """`data` without those of `keys` whose value is None (fields only a reasoning parser sets)."""
    return {k: v for k, v in data.items() if not (k in keys and v is None)}


def _with_reasoning(data: dict) -> dict:
    """The reasoning under both names clients read: reasoning_content (DeepSeek's, and vLLM's
    until late 2025) and reasoning (vLLM's and OpenRouter's since)."""
    if data.get("reasoning_content") is not None:
        data["reasoning"] = data["reasoning_content"]
    return data


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0  # the reasoning's tokens included
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = None  # with a reasoning parser

    @model_serializer(mode="wrap")
    def _details_when_known(self, handler):
        return _without_none(handler(self), "completion_tokens_details")


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None  # the stop string or token id that ended it (vLLM extra)
    # return_token_ids (vLLM's): the prompt's ids (a stream's first chunk of a choice) and the choice's
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # A reasoning model's thinking (--reasoning-parser); sent as `reasoning` too.
    reasoning_content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _reasoning_when_parsed(self, handler):
        return _with_reasoning(_without_none(handler(self), "reasoning_content"))


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids (vLLM's)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids (vLLM's)


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _only_set(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _only_set(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _only_set(self, handler):  # OpenAI deltas omit absent keys
        return _with_reasoning({k: v for k, v in handler(self).items() if v is not None})


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: the tokens this chunk's output brought


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: with each choice's first chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagewise"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --------------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx body, in OpenAI's shape."""

    error: ErrorInfo


# --------------------------------------------------------------------------- tokenize / detokenize, embeddings
class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of little-endian float32, for encoding_format base64
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
