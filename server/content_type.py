"""Bodies are JSON only: plain UTF-8 JSON, not compressed (HTTP 415 otherwise, saying which).

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
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            return await self.app(scope, receive, send)
        headers = {name.decode("latin-1").lower(): value.decode("latin-1").strip().lower()
                   for name, value in scope.get("headers", ())}
        if not _has_body(headers):  # nothing to refuse: the route answers (405 where it takes no POST)
            return await self.app(scope, receive, send)
        problem = _problem(headers)
        if problem is None:
            return await self.app(scope, receive, send)
        await error_response(415, problem, code="unsupported_media_type")(scope, receive, send)


def _has_body(headers: dict[str, str]) -> bool:
    return "transfer-encoding" in headers or headers.get("content-length", "0") not in ("", "0")


def _problem(headers: dict[str, str]) -> str | None:
    """What is wrong with the body's declared type, or None."""
    media_type, _, params = headers.get("content-type", "").partition(";")
    if media_type.strip() != "application/json":
        return "request body must be JSON: send it with 'Content-Type: application/json'"
    charsets = [p.split("=", 1)[1].strip().strip('"') for p in params.split(";") if p.strip().startswith("charset=")]
    charset = charsets[0] if charsets else "utf-8"
    if charset not in ("utf-8", "utf8"):
        return f"request body must be UTF-8 JSON (RFC 8259), not charset {charset}"
    encoding = headers.get("content-encoding", "identity")
    if encoding != "identity":
        return f"compressed request bodies are not accepted (Content-Encoding: {encoding}): send the JSON as it is"
    return None
