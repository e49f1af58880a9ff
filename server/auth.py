"""API-key check: `Authorization: Bearer <key>` on every route but /health and /metrics (unless
protected), when a key is set."""

from __future__ import annotations

import hmac

from server.errors import error_response

OPEN_PATHS = frozenset({"/health"})  # load balancers probe without credentials
METRICS_PATH = "/metrics"  # open too by default: Prometheus scrapes without credentials (as vLLM)


class APIKeyMiddleware:
    def __init__(self, app, api_key: str, protect_metrics: bool = False):
        self.app = app
        self._key = api_key.encode()
        self._open = OPEN_PATHS if protect_metrics else OPEN_PATHS | {METRICS_PATH}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self._open or self._authorized(scope):
            return await self.app(scope, receive, send)
        response = error_response(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                  code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                # compare_digest: the time taken does not reveal how much of the key matched
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
        return False
