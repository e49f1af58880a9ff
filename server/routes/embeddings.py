"""POST /v1/embeddings: one engine request per input, run as a prompt that generates nothing and
ends with its pooled final hidden states (SamplingParams.pooling), in OpenAI's response shape.

What it is good for: the served model's own representation of a text, for similarity search,
clustering or a classifier on top, without a second model in memory. A causal LM trained for
generation is not a trained embedding model (it was never taught that similar texts should land
close together), so expect retrieval quality below a dedicated embedding model of its size;
last-token pooling (the default: the only position that has seen the whole input) usually does
better than the mean for such models."""

from __future__ import annotations

import base64
import struct

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.sampling_params import SamplingParams
from server.openapi import route_docs
from server.prompts import prompt_items
from server.protocol import EmbeddingRequest
from server.responses import EmbeddingData, EmbeddingResponse, EmbeddingUsage
from server.routes.common import engine_errors, new_id, read_request
from server.streams import ClientDisconnected, last_outputs, primed_all, unless_disconnected

router = APIRouter()


@router.post("/v1/embeddings", **route_docs(EmbeddingRequest, EmbeddingResponse))
async def create_embeddings(request: Request):
    state, body = await read_request(request, EmbeddingRequest)
    state.check_admissible(len(prompt_items(body.input)), 1)
    prompts = await state.prompts.completion_prompts(body.input, param="input", generates=False)
    params = SamplingParams(max_tokens=1, pooling=body.pooling)
    request_id = new_id("embd")
    lora = state.lora_request(body.model)
    streams = [state.metrics.track(state.engine.generate(f"{request_id}-{i}", p.token_ids, params, prompt=p.text,
                                                         delta=False, lora_request=lora), 1, lora)
               for i, p in enumerate(prompts)]
    try:
        with engine_errors({"prompt": "input"}):
            streams = await unless_disconnected(request, primed_all(streams))
            finals = await unless_disconnected(request, last_outputs(streams))
    except ClientDisconnected:
        return Response(status_code=499)  # nobody is listening; the requests were aborted
    data = [EmbeddingData(embedding=_encode(out.embedding, body.encoding_format), index=i)
            for i, out in enumerate(finals)]
    tokens = sum(len(p.token_ids) for p in prompts)
    response = EmbeddingResponse(data=data, model=state.model_name(body.model),
                                 usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
    return Response(response.model_dump_json(), media_type="application/json")


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # what the openai client asks for by default, and decodes
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector
