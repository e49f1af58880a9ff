"""POST /v1/embeddings' request."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import WithJsonSchema, field_validator

from server.protocol.fields import Int, PromptField, _Request, _prompt_shape, _unsupported


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
