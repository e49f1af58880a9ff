"""Bodies are JSON only (HTTP 415 otherwise).

A browser page may send a "simple" cross-origin POST (Content-Type text/plain, no CORS preflight)
to a server on the user's machine; refusing every body that is not `application/json` means
such a request does no work. A JSON POST from a page needs a preflight, which fails unless
`--allowed-origins` lists the page's origin."""

from __future__ import annotations

from server.errors import error_response

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class JSONOnlyMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS or _is_json(scope):
            return await self.app(scope, receive, send)
        response = error_response(415, "request body must be JSON: send it with 'Content-Type: application/json'",
                                  code="unsupported_media_type")
        await response(scope, receive, send)


def _is_json(scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            media_type = value.split(b";", 1)[0].strip().lower()
            return media_type == b"application/json"
    return False
