"""OpenAI request types (pydantic), one module a route, and the request -> SamplingParams mapping
(sampling.py; response bodies: server/responses.py).

Requests are strict: a wrong type is an error, not a coercion ("5" is not 5), and any field
we do not implement is a 400 that names it, never silently dropped. Fields that exist in
OpenAI's API but that we do not support are accepted only at their no-op value
(`functions: []`, `suffix: ""`, ...).
"""

from server.protocol.chat import ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool
from server.protocol.completions import CompletionRequest
from server.protocol.embeddings import EmbeddingRequest
from server.protocol.fields import SERVED_BOUND
from server.protocol.lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from server.protocol.tokenize import DetokenizeRequest, TokenizeRequest

__all__ = ["SERVED_BOUND", "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "DetokenizeRequest",
           "EmbeddingRequest", "LoadLoRAAdapterRequest", "NamedToolChoice", "TokenizeRequest", "Tool",
           "UnloadLoRAAdapterRequest"]
