"""GET /v1/models, /health, /version, /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import engine
from server.errors import error_response
from server.responses import ModelCard, ModelList
from server.state import get_state

router = APIRouter()


def _card(request: Request, name: str | None = None) -> ModelCard:
    """The base model's card, or the card of adapter `name` (its parent: the base model)."""
    state = get_state(request)
    lora = state.lora_request(name)
    if lora is not None:
        return ModelCard(id=lora.lora_name, created=state.created, root=lora.lora_path,
                         parent=state.served_model_name, max_model_len=state.max_model_len)
    return ModelCard(id=state.served_model_name, created=state.created, root=state.engine.model_name,
                     max_model_len=state.max_model_len)


@router.get("/v1/models")
async def list_models(request: Request):
    adapters = get_state(request).adapters.by_name
    return ModelList(data=[_card(request), *(_card(request, name) for name in list(adapters))])


@router.get("/v1/models/{model:path}")
async def get_model(model: str, request: Request):
    get_state(request).check_model(model)
    return _card(request, model)


@router.api_route("/health", methods=["GET", "HEAD"])  # HEAD: what some load balancers probe with
async def health(request: Request):
    try:
        get_state(request).engine.check_health()
    except Exception as e:  # says why (the full traceback is in the server log)
        return error_response(503, f"engine is not healthy: {e}", code="unhealthy")
    return JSONResponse({"status": "ok"})


@router.get("/version")
async def version():
    return {"version": engine.__version__}


@router.get("/metrics")
async def metrics(request: Request):
    return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)
