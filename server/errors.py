"""Every error leaves the server in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("pagewise.server")

# OpenAI's own `type` values; clients (the openai package) pick the exception class by status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error a client caused (or may retry): carries the HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def format_loc(loc) -> str:
    """pydantic's ('messages', 2, 'role') -> 'messages[2].role' (OpenAI's `param` style)."""
    out = ""
    for part in loc:
        if isinstance(part, str) and not part.isidentifier() or part in UNION_TAGS:
            continue  # a union member's tag such as 'list[ContentPart]' or 'str', not a field
        if isinstance(part, int):
            out += f"[{part}]"
        elif part not in ("body",):
            out += f".{part}" if out else str(part)
    return out


# pydantic's type errors in JSON's words (its own name a model class, e.g. "instance of Tool").
JSON_TYPES = {"model_type": "a JSON object", "dict_type": "a JSON object", "model_attributes_type": "a JSON object",
              "string_type": "a string", "list_type": "an array", "int_type": "an integer",
              "int_from_float": "an integer", "float_type": "a number", "bool_type": "true or false",
              "none_required": "null"}


def _most_telling(errors: list[dict]) -> dict:
    """A union (e.g. content: str | list[parts]) reports one error per member: our own ValueErrors
    say most; then an error about the value (a range, a length) beats one about its type, which
    only says the value took another member's form; of type errors, the deepest is inside the
    member whose form the value has."""
    for wanted in (lambda e: e.get("type") == "value_error", lambda e: e.get("type") not in JSON_TYPES):
        found = next((e for e in errors if wanted(e)), None)
        if found is not None:
            return found
    return max(errors, key=lambda e: len(e.get("loc", ())))


def validation_error(errors: list[dict]) -> APIError:
    """The most telling pydantic error, rewritten to name the field and say what to change."""
    err = _most_telling(errors)
    if err.get("type") == "json_invalid":
        why = err.get("ctx", {}).get("error", err["msg"])
        if "recursion limit" in why:  # valid JSON, past the parser's depth
            return bad_request("request body is nested too deeply (over ~200 levels of arrays and objects)",
                               code="invalid_json")
        if "hex escape" in why:  # serde's words for a lone surrogate: say what it means
            why += " (a \\ud800-\\udfff escape is half of a UTF-16 surrogate pair and needs its other half)"
        return bad_request(f"request body is not valid JSON: {why}", code="invalid_json")
    param = format_loc(err.get("loc", ())) or None
    msg = err.get("msg", "invalid value")
    if err.get("type") == "extra_forbidden":
        name = str(err["loc"][-1]) if err.get("loc") else ""
        param = param if param and param.endswith(name) else name  # a key like "" or "a b" is no identifier
        return bad_request(f"{param!r} is not a supported field: remove it", param=param, code="unsupported_field")
    if err.get("type") == "missing":
        return bad_request(f"{param} is required", param=param, code="missing_field")
    if err.get("type") == "too_short":
        return bad_request(f"{param} must not be empty", param=param)
    if err.get("type") == "model_type" and not param:
        return bad_request("request body must be a JSON object", code="invalid_json")
    if err.get("type") in JSON_TYPES:
        msg = f"must be {JSON_TYPES[err['type']]}"
    msg = msg.removeprefix("Value error, ")
    return bad_request(f"{param}: {msg}" if param else msg, param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message = f"no route for {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))


class InternalErrorMiddleware:
    """A 500 in OpenAI's shape for an exception no handler took, with the traceback in the server
    log and no internals for the client. Sent here, not by an exception handler for Exception:
    Starlette's ServerErrorMiddleware, which runs those, re-raises after sending, and uvicorn then
    closes the connection, so a keep-alive client's next request on it failed with a reset. Added
    last (outermost of ours), so it also covers the other middleware."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as exc:
            if started:
                raise  # a response under way cannot turn into a 500: uvicorn closes the connection
            logger.error("internal error on %s %s", scope["method"], scope["path"], exc_info=exc)
            await error_response(500, "internal server error", code="internal_error")(scope, receive, send)
