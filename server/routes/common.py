"""Shared by the generation routes: body parsing, engine-error mapping, ids."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import re
import uuid
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from engine import structured_output
from engine.frontend.async_engine import (EngineDeadError, EngineOverloadedError, RequestFailedError,
                                          RequestInvalidError)
from server.errors import APIError, bad_request, error_body, validation_error
from server.state import ServerState, get_state

B = TypeVar("B", bound=BaseModel)

RETRY_AFTER_S = "1"
# Requests with a grammar are checked here, each waiting up to grammar_compile_timeout_s for its
# compile; a few at a time, so that they never take the threads the server tokenizes with.
_GRAMMAR_CHECKS = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="pagewise-grammar-check")
_FIELD = re.compile(r"^([a-z_]+)\b")
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


async def check_request(state: ServerState, prompt_token_ids: list[int], params) -> None:
    """The engine's admission checks (a ValueError naming the field). A request with a grammar is
    checked off the event loop: its bounds, then the engine's checks, then its compile, which the
    request waits for here so that it enters the engine with its grammar ready."""
    if params.structured_outputs is None:
        state.engine.check_request(prompt_token_ids, params)
        return
    await asyncio.get_running_loop().run_in_executor(_GRAMMAR_CHECKS, _check_with_grammar, state,
                                                     prompt_token_ids, params)


def _check_with_grammar(state: ServerState, prompt_token_ids: list[int], params) -> None:
    spec = params.structured_outputs
    structured_output.check_bounds(spec, state.engine.config)
    state.engine.check_request(prompt_token_ids, params)
    structured_output.wait_compiled(spec, params.max_tokens)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@contextlib.contextmanager
def sampling_errors(renames: dict[str, str] | None = None):
    """SamplingParams' ValueError names the field; report it under the request's own field name."""
    try:
        yield
    except ValueError as e:
        message, param = str(e), _field(e)
        if param and renames and param in renames:
            message = renames[param] + message[len(param):]
            param = renames[param]
        raise bad_request(message, param=param) from None


@contextlib.contextmanager
def engine_errors():
    """AsyncEngine's failures as HTTP errors: overload 503 (+Retry-After), a rejected prompt or
    parameters that left no token partway 400, a dead engine 500 without internals."""
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
        raise bad_request(str(e), param=_field(e), code=UNSATISFIABLE) from None
    except ValueError as e:  # EngineCore.add_request rejected the prompt
        raise bad_request(str(e), param="prompt" if (_field(e) or "").startswith("prompt") else None) from None


def _field(error: BaseException) -> str | None:
    """The field an error's message starts with (our ValueErrors name theirs first), or None."""
    m = _FIELD.match(str(error))
    return m.group(1) if m else None


def error_event_body(error: BaseException) -> dict:
    """The payload of an SSE error event, for a failure after the stream has started."""
    if isinstance(error, RequestInvalidError):
        return error_body(400, str(error), _field(error), UNSATISFIABLE)
    if isinstance(error, EngineDeadError):  # the code a whole response gets for it too
        return error_body(500, "internal server error: the engine stopped", code="engine_dead")
    if isinstance(error, RequestFailedError):
        message = "internal server error while processing this request; other requests are unaffected"
    else:
        message = "internal server error"
    return {"error": {"message": message, "type": "server_error", "param": None, "code": "internal_error"}}
