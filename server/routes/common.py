"""Shared by the generation routes: body parsing, engine-error mapping, ids."""

from __future__ import annotations

import contextlib
import uuid
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from engine.sampling_params import RequestError
from engine.frontend.async_engine import (EngineDeadError, EngineOverloadedError, RequestFailedError,
                                          RequestInvalidError)
from server.errors import APIError, bad_request, error_body, validation_error
from server.state import ServerState, get_state

B = TypeVar("B", bound=BaseModel)

RETRY_AFTER_S = "1"
UNSATISFIABLE = "unsatisfiable_request"  # the code of a request whose parameters left no token partway


def parse_body(model: type[BaseModel], raw: bytes) -> BaseModel:
    if not raw.strip():
        raise bad_request("request body is empty: send a JSON object", code="invalid_json")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


async def read_request(request, model: type[B]) -> tuple[ServerState, B]:
    """What every POST route starts with: the server's state, and the body parsed as `model` with
    its `model` field checked against the served name."""
    state = get_state(request)
    body = parse_body(model, await request.body())
    state.check_model(body.model)
    return state, body


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@contextlib.contextmanager
def sampling_errors(renames: dict[str, str] | None = None):
    """A RequestError (SamplingParams', the engine's admission checks') as a 400 whose `param` and
    message name the field as the client sent it: `renames` maps the engine's field names to the
    route's."""
    try:
        yield
    except RequestError as e:
        raise request_error(e, renames) from None


def request_error(error: RequestError, renames: dict[str, str] | None = None, code: str | None = None) -> APIError:
    name = (renames or {}).get(error.field, error.field)
    return bad_request(error.named(name), param=name or None, code=code or error.code)


@contextlib.contextmanager
def engine_errors(renames: dict[str, str] | None = None):
    """AsyncEngine's failures as HTTP errors: overload 503 (+Retry-After), a rejected prompt or
    parameters that left no token partway 400 (named as in sampling_errors), a dead engine 500
    without internals."""
    try:
        yield
    except EngineOverloadedError as e:
        raise APIError(503, f"server is overloaded, retry later: {e}", code="overloaded",
                       headers={"Retry-After": RETRY_AFTER_S}) from None
    except EngineDeadError:
        raise APIError(500, "internal server error: the engine stopped", code="engine_dead") from None
    except RequestFailedError:  # the engine failed this request alone and serves on
        raise APIError(500, "internal server error while processing this request; other requests are "
                            "unaffected", code="internal_error") from None
    except RequestInvalidError as e:  # its parameters left no token to sample partway through
        raise request_error(e, renames, UNSATISFIABLE) from None
    except RequestError as e:  # EngineCore.add_request rejected the request
        raise request_error(e, renames) from None


def error_event_body(error: BaseException, renames: dict[str, str] | None = None) -> dict:
    """The payload of an SSE error event, for a failure after the stream has started."""
    if isinstance(error, RequestInvalidError):
        e = request_error(error, renames, UNSATISFIABLE)
        return error_body(400, e.message, e.param, UNSATISFIABLE)
    if isinstance(error, EngineDeadError):  # the code a whole response gets for it too
        return error_body(500, "internal server error: the engine stopped", code="engine_dead")
    if isinstance(error, RequestFailedError):
        message = "internal server error while processing this request; other requests are unaffected"
    else:
        message = "internal server error"
    return {"error": {"message": message, "type": "server_error", "param": None, "code": "internal_error"}}
