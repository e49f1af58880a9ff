"""The fields /v1/completions and /v1/chat/completions share, and their mapping to SamplingParams."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field, WithJsonSchema, field_validator

from engine.sampling_params import (MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_N, MIN_REPETITION_PENALTY,
                                    SEED_MAX, SEED_MIN, GrammarSpec, RequestError, SamplingParams)
from server.protocol.fields import (FloatIn, IntIn, LOGIT_BIAS_SCHEMA, NonEmpty, ResponseFormat, StreamOptions,
                                    StructuredOutputs, TokenId, _Request, _logit_bias_keys, _needs)


STREAM_OPTIONS_RULE = _needs("stream_options", {"type": "null"}, "stream", {"const": True})


class _SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions, plus the engine's extras. The
    ranges are SamplingParams' (which checks them for the engine's own callers too)."""

    model: str | None = None  # optional: the served model, or a LoRA adapter it serves by name
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
    return_token_ids: bool = False  # the prompt's and each choice's token ids in the response (vLLM's)
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
