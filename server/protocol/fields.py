"""Building blocks of the request types: bounded number and id fields, the prompt's shape, response_format and
structured_outputs, and the strict base model (a wrong type is an error, not a coercion)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, WithJsonSchema, model_validator

from engine.sampling_params import MAX_LOGIT_BIAS


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
