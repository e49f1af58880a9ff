"""An exception no handler takes is a 500 in OpenAI's shape, and the connection it came on serves
the next request: two requests pipelined on one socket to a real uvicorn server, the first to a
route that raises. (Starlette's own 500 re-raises after sending it, and uvicorn then closed the
connection: a keep-alive client's next request was reset.)"""

from __future__ import annotations

import json
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from server.errors import InternalErrorMiddleware, install_error_handlers


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("a bug")

    @app.get("/ok")
    async def ok():
        return PlainTextResponse("fine")

    app.add_middleware(InternalErrorMiddleware)
    return app


def _responses(raw: bytes) -> list[tuple[int, bytes]]:
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        out.append((status, rest[:length]))
        raw = rest[length:]
    return out


def test_an_unhandled_exception_is_a_500_and_the_connection_serves_on():
    server = uvicorn.Server(uvicorn.Config(_app(), host="127.0.0.1", port=0, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\nGET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
            raw = b""
            while raw.count(b"HTTP/1.1 ") < 2 or not raw.endswith(b"fine"):
                chunk = sock.recv(65536)
                if not chunk:
                    break  # closed: the second response never came
                raw += chunk
        (status, body), *rest = _responses(raw)
        assert status == 500 and json.loads(body) == {"error": {
            "message": "internal server error", "type": "server_error", "param": None, "code": "internal_error"}}
        assert rest == [(200, b"fine")], raw
    finally:
        server.should_exit = True
        thread.join(30)
