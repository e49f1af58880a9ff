"""build_app(engine): the FastAPI app around an AsyncEngine (started and shut down with the app)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

import engine as engine_pkg
from server.adapters import ServedAdapters
from server.auth import APIKeyMiddleware
from server.content_type import JSONOnlyMiddleware
from server.errors import InternalErrorMiddleware, install_error_handlers
from server.limits import BodySizeLimitMiddleware
from server.logprobs import TokenTexts
from server.metrics import ServerMetrics
from server.openapi import install_openapi
from server.prompts import PromptTokenizer
from server.routes import chat, completions, embeddings, info, lora, tokenize
from server.tool_calls import ToolConfig
from server.state import ServerState

logger = logging.getLogger("pagewise.server")

DEFAULT_MAX_BODY_BYTES = 8 << 20  # a full context of token ids as JSON fits many times over
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


def build_app(engine, *, served_model_name: str | None = None, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
              allowed_origins: list[str] | None = None, protect_metrics: bool = False,
              exit_on_engine_death: bool = False, tools: ToolConfig | None = None,
              parse_special_tokens_in_messages: bool = False, lora_modules: list | None = None,
              runtime_lora: bool = False) -> FastAPI:
    """`engine` is an AsyncEngine (or anything with its interface); it is started by the app's
    lifespan, so the model loads before the first request is accepted.

    allowed_origins: browser origins allowed to call the API (CORS); None keeps CORS closed.
    protect_metrics: /metrics needs the API key too (by default Prometheus scrapes it openly).
    tools: --enable-auto-tool-choice and --tool-call-parser (server/tool_calls.py).
    parse_special_tokens_in_messages: special-token text from the client is read as control tokens in
    chat prompts (server/prompts.py), as transformers and vLLM do; by default it is plain text.
    lora_modules: server.adapters.LoRAModule items served by name from the start (each checked with the
    engine first: a bad one stops the start); runtime_lora: /v1/load_lora_adapter and /v1/unload_lora_adapter.
    exit_on_engine_death: when the engine loop dies (a failed forward, a dead worker), stop the
    server process (SIGTERM to itself) so that a supervisor restarts it; /health says why meanwhile."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        name = served_model_name or engine.model_name
        adapters = ServedAdapters(runtime_lora)
        for module in lora_modules or ():
            lora = adapters.make(module)
            await asyncio.to_thread(engine.check_lora, lora)  # a bad adapter stops the start, naming it
            adapters.add(lora)
        prompts = PromptTokenizer(engine.tokenizer, engine.max_model_len, parse_special_tokens_in_messages)
        app.state.pagewise = ServerState(engine=engine, served_model_name=name,
                                         metrics=ServerMetrics(engine, name),
                                         token_texts=TokenTexts(engine.tokenizer), prompts=prompts,
                                         tools=tools or ToolConfig(), adapters=adapters)
        if exit_on_engine_death:
            engine.on_death(_exit_for_restart)
        logger.info("engine ready: model %s (max_model_len %d)", name, engine.max_model_len)
        try:
            yield
        finally:
            await engine.shutdown(shutdown_timeout)
            prompts.close()

    app = FastAPI(title="pagewise", version=engine_pkg.__version__, lifespan=lifespan,
                  description="An OpenAI-compatible API (completions, chat completions, embeddings, models; "
                              "vLLM's tokenize and detokenize) "
                              "served by the pagewise engine.")
    install_error_handlers(app)
    for module in (info, completions, chat, embeddings, tokenize, lora):
        app.include_router(module.router)
    install_openapi(app)
    # Starlette runs the middleware added last first: a 500 for what no handler took, CORS (answers
    # preflights), then the key (checked before a byte of the body is read), then JSON only, then
    # the size limit.
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=max_body_bytes)
    app.add_middleware(JSONOnlyMiddleware)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, protect_metrics=protect_metrics)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(InternalErrorMiddleware)
    app.state.engine = engine
    app.state.shutdown_timeout = shutdown_timeout
    return app


def _exit_for_restart(cause: BaseException) -> None:
    logger.error("the engine stopped (%s: %s); the server exits so that its supervisor restarts it",
                 type(cause).__name__, cause)
    os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's handler: stop accepting, close, run the lifespan end
