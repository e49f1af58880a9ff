"""/openapi.json that says what the routes take and answer.

The generation routes read their body themselves (to give OpenAI-shaped errors and to bound
the work before parsing), so FastAPI cannot see their request models: `route_docs` names them,
and `install_openapi` adds their schemas to the document's components."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from server.responses import ErrorResponse

_REF = "#/components/schemas/{model}"

ERROR_RESPONSES = {
    400: "invalid request: the message names the field (`param`) and what to change",
    401: "missing or wrong API key (when the server has one)",
    404: "unknown model or route",
    413: "request body larger than the server's limit",
    415: "body is not `application/json`",
    500: "internal error: the engine failed this request, or stopped",
    503: "overloaded or shutting down: retry after `Retry-After` seconds",
}

_request_models: list[type[BaseModel]] = []


def route_docs(request_model: type[BaseModel], response_model: type[BaseModel]) -> dict:
    """Keyword arguments for a POST route: its JSON body, its 200 (JSON or server-sent events), its errors."""
    _request_models.append(request_model)
    responses = {code: {"model": ErrorResponse, "description": text} for code, text in ERROR_RESPONSES.items()}
    responses[200] = {"model": response_model, "description": "the response; with `stream: true`, "
                      "server-sent events (`data: <chunk JSON>` lines, then `data: [DONE]`)",
                      "content": {"text/event-stream": {"schema": {"type": "string"}}}}
    body = {"required": True, "content": {"application/json": {"schema": {"$ref": _REF.format(
        model=request_model.__name__)}}}}
    return {"responses": responses, "openapi_extra": {"requestBody": body}}


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                 description=app.description)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in _request_models:
                model_schema = model.model_json_schema(ref_template=_REF)
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
