"""POST /v1/completions' request."""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, WithJsonSchema, field_validator

from engine.sampling_params import MAX_N, SamplingParams
from server.protocol.fields import IntIn, Logprobs, MaxTokens, PromptField, _prompt_shape, _rules, _unsupported
from server.protocol.sampling import STREAM_OPTIONS_RULE, _SamplingRequest


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
