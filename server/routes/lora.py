"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's): adapters added and removed while
serving, with --enable-runtime-lora. An adapter is checked with the engine before it is served; an
unloaded one is refused to new requests at once, while the requests already running with it finish."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from engine.sampling_params import RequestError
from server.adapters import LoRAModule
from server.errors import APIError, bad_request
from server.openapi import route_docs
from server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from server.routes.common import parse_body, request_error
from server.state import ServerState, get_state

router = APIRouter()


def _runtime_state(request: Request) -> ServerState:
    state = get_state(request)
    if not state.adapters.runtime_updates:
        raise APIError(404, "loading and unloading LoRA adapters while serving is off: start the server with "
                            "--enable-lora --enable-runtime-lora", code="not_found")
    return state


@router.post("/v1/load_lora_adapter", **route_docs(LoadLoRAAdapterRequest, None, "text/plain"))
async def load_lora_adapter(request: Request):
    state = _runtime_state(request)
    body = parse_body(LoadLoRAAdapterRequest, await request.body())
    if body.lora_name == state.served_model_name or state.adapters.get(body.lora_name) is not None:
        raise bad_request(f"the LoRA adapter {body.lora_name!r} has already been loaded: unload it first, or "
                          "choose another name", param="lora_name", code="adapter_exists")
    lora = state.adapters.make(LoRAModule(body.lora_name, body.lora_path))
    try:
        await asyncio.to_thread(state.engine.check_lora, lora)
    except RequestError as e:
        raise request_error(e, {"lora_request": "lora_path"}) from None
    state.adapters.add(lora)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", **route_docs(UnloadLoRAAdapterRequest, None, "text/plain"))
async def unload_lora_adapter(request: Request):
    state = _runtime_state(request)
    body = parse_body(UnloadLoRAAdapterRequest, await request.body())
    if state.adapters.remove(body.lora_name) is None:
        raise APIError(404, f"the LoRA adapter {body.lora_name!r} cannot be found", param="lora_name",
                       code="model_not_found")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
