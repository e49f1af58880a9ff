"""Server-sent events in OpenAI's framing: `data: <json>\\n\\n` per chunk, `data: [DONE]` at the end."""

from __future__ import annotations

import json

from pydantic import BaseModel
from starlette.responses import StreamingResponse

DONE = "data: [DONE]\n\n"


def event(payload: BaseModel | dict) -> str:
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json()
    else:
        data = json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def sse_response(events) -> StreamingResponse:
    # no-cache and no proxy buffering: each token should reach the client when it is made
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
