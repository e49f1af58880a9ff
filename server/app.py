"""build_app(engine): the FastAPI app around an AsyncEngine (started and shut down with the app)."""

from __future__ import annotations

import contextlib
import logging

from fastapi import FastAPI

import engine as engine_pkg
from server.auth import APIKeyMiddleware
from server.errors import install_error_handlers
from server.limits import BodySizeLimitMiddleware
from server.logprobs import TokenTexts
from server.metrics import ServerMetrics
from server.routes import chat, completions, info
from server.state import ServerState

logger = logging.getLogger("pagewise.server")

DEFAULT_MAX_BODY_BYTES = 8 << 20  # a full context of token ids as JSON fits many times over
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


def build_app(engine, *, served_model_name: str | None = None, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> FastAPI:
    """`engine` is an AsyncEngine (or anything with its interface); it is started by the app's
    lifespan, so the model loads before the first request is accepted."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        name = served_model_name or engine.model_name
        app.state.pagewise = ServerState(engine=engine, served_model_name=name,
                                         metrics=ServerMetrics(engine, name),
                                         token_texts=TokenTexts(engine.tokenizer))
        logger.info("engine ready: model %s (max_model_len %d)", name, engine.max_model_len)
        try:
            yield
        finally:
            await engine.shutdown(shutdown_timeout)

    app = FastAPI(title="pagewise", version=engine_pkg.__version__, lifespan=lifespan)
    install_error_handlers(app)
    for module in (info, completions, chat):
        app.include_router(module.router)
    # Outermost last: the key is checked before a byte of the body is read.
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.state.engine = engine
    app.state.shutdown_timeout = shutdown_timeout
    return app
