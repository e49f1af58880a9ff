"""/openapi.json that says what the routes take and answer: the request bodies with the server's own
constraints, every status code the server can send on each route, and each response's media type.

The generation routes read their body themselves (to give OpenAI-shaped errors and to bound
the work before parsing), so FastAPI cannot see their request models: `route_docs` names them,
and `install_openapi` adds their schemas to the document's components. The errors that the
middleware sends on any route (a bad Content-Length, the API key, an internal error, shutting
down) are added to every operation there too."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from server.protocol import SERVED_BOUND
from server.responses import ErrorResponse

_REF = "#/components/schemas/{model}"
_ERROR = {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}

ERROR_RESPONSES = {
    400: "invalid request: the message names the field (`param`) and what to change",
    401: "missing or wrong API key (when the server has one)",
    404: "unknown model or route",
    413: "request body larger than the server's limit",
    415: "body is not `application/json`",
    500: "internal error: the engine failed this request, or stopped",
    503: "overloaded or shutting down: retry after `Retry-After` seconds",
}
# What any route may answer, whatever it does: an unreadable request (a Content-Length that is not
# a number), the API key, an internal error, a server shutting down.
ANY_ROUTE = {
    400: "the HTTP request itself is malformed (e.g. its Content-Length)",
    401: "missing or wrong API key (when the server has one; /health never asks, /metrics only with "
         "--protect-metrics)",
    500: "internal error",
    503: "shutting down, or (/health) the engine is not healthy",
}
# The status a request that its client abandoned is logged with (nobody reads it).
CLIENT_GONE = {499: {"description": "the client closed the connection before the response; the request was "
                                    "aborted"}}
# Responses whose bodies are not JSON.
MEDIA_TYPES = {("/metrics", "get"): {"text/plain": {"schema": {"type": "string"}}}}
# Bodies FastAPI cannot infer (the routes return plain dicts).
BODIES = {
    ("/health", "get"): {"type": "object", "properties": {"status": {"const": "ok"}}, "required": ["status"]},
    ("/version", "get"): {"type": "object", "properties": {"version": {"type": "string"}}, "required": ["version"]},
}
# Path routes whose parameter names a model: an unknown one is a 404.
MODEL_PATHS = ("/v1/models/{model}",)

# One server-sent event, as OpenAPI 3.1 documents a stream's events: `data` holds a chunk's JSON
# (the 200's schema), an error's (ErrorResponse) or `[DONE]`.
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a chunk's JSON, an error's JSON, or [DONE] (the last event)"},
    "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}

_request_models: list[type[BaseModel]] = []


def route_docs(request_model: type[BaseModel], response_model: type[BaseModel] | None,
               media_type: str = "application/json") -> dict:
    """Keyword arguments for a POST route: its JSON body, its 200 (JSON, or server-sent events where
    the request has `stream`; a text of `media_type` where there is no response model), its errors."""
    _request_models.append(request_model)
    responses = {code: {"model": ErrorResponse, "description": text} for code, text in ERROR_RESPONSES.items()}
    responses[200] = ({"model": response_model, "description": "the response"} if response_model is not None else
                      {"description": "the response", "content": {media_type: {"schema": {"type": "string"}}}})
    if "stream" in request_model.model_fields:
        responses[200]["description"] += ("; with `stream: true`, server-sent events (`data: <chunk JSON>` lines, "
                                          "then `data: [DONE]`)")
        responses[200]["content"] = {"text/event-stream": {"schema": SSE_EVENT}}
        responses.update(CLIENT_GONE)
    body = {"required": True, "content": {"application/json": {"schema": {"$ref": _REF.format(
        model=request_model.__name__)}}}}
    return {"responses": responses, "openapi_extra": {"requestBody": body}}


def _complete(paths: dict) -> None:
    """Every operation: the errors any route may send, no 422 (validation errors are 400s here),
    the right media type and body for the routes FastAPI cannot see into."""
    for path, operations in paths.items():
        for method, op in operations.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            codes = {**ANY_ROUTE, **({404: ERROR_RESPONSES[404]} if path in MODEL_PATHS else {})}
            for code, text in codes.items():
                responses.setdefault(str(code), {"description": text, "content": _ERROR})
            ok = responses.setdefault("200", {"description": "the response"})
            if (path, method) in MEDIA_TYPES:
                ok["content"] = MEDIA_TYPES[path, method]
            elif (path, method) in BODIES:
                ok["content"] = {"application/json": {"schema": BODIES[path, method]}}


def _served_bounds(schema, bounds: dict[str, int]) -> None:
    """Each bound the served engine sets becomes the schema's maximum (the marker goes)."""
    if isinstance(schema, dict):
        bound = schema.pop(SERVED_BOUND, None)
        if bound in bounds:
            schema["maximum"] = bounds[bound]
        for value in schema.values():
            _served_bounds(value, bounds)
    elif isinstance(schema, list):
        for value in schema:
            _served_bounds(value, bounds)


def served_bounds(state) -> dict[str, int]:
    """The largest token id (of what both the tokenizer and the model know), the longest output (a
    prompt takes a token at least), the most logprobs."""
    if state is None:
        return {}
    vocab = min(v for v in (len(state.tokenizer), getattr(state.engine, "vocab_size", None)) if v)
    bounds = {"token_id": vocab - 1, "max_tokens": state.max_model_len - 1,
              "logprobs": getattr(getattr(state.engine, "config", None), "max_logprobs", None)}
    return {name: bound for name, bound in bounds.items() if isinstance(bound, int)}


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                 description=app.description)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            state = getattr(app.state, "pagewise", None)  # built once the engine has started
            for model in _request_models:
                model_schema = model.model_json_schema(ref_template=_REF)
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
                if state is not None and "model" in model_schema["properties"]:  # any other name is a 404
                    model_schema["properties"]["model"] = {"anyOf": [{"const": state.served_model_name},
                                                                     {"type": "null"}]}
            _served_bounds(components, served_bounds(state))
            for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 body, never sent here
                components.pop(name, None)
            _complete(schema.get("paths", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
