"""Request-body size limit (HTTP 413), checked on Content-Length and on the bytes actually received."""

from __future__ import annotations

from server.errors import error_response

# Past the limit we keep reading (and dropping) up to this much more, so the client sees a
# clean 413 instead of a reset connection mid-upload; beyond it we answer and stop reading.
DRAIN_BYTES = 16 << 20


class BodySizeLimitMiddleware:
    """Reads the whole body (every endpoint needs it all anyway), then replays it to the app."""

    def __init__(self, app, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared == -1:
            return await error_response(400, "Content-Length header is not a valid integer")(scope, receive, send)
        if declared is not None and declared > self.max_body_bytes:
            await _drain(receive, min(declared, DRAIN_BYTES))
            return await self._too_large(scope, receive, send)

        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nothing to answer
            body = message.get("body", b"")
            size += len(body)
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                if more:
                    await _drain(receive, DRAIN_BYTES)
                return await self._too_large(scope, receive, send)
            chunks.append(body)

        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # later calls wait for http.disconnect, as the app expects

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        response = error_response(413, f"request body is larger than the limit of {self.max_body_bytes} bytes",
                                  code="request_too_large")
        await response(scope, receive, send)


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return -1
    return None


async def _drain(receive, limit: int) -> None:
    seen = 0
    while seen <= limit:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return
