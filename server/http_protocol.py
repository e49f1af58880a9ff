"""uvicorn's HTTP protocol with the read timeouts a production server has, its own 400s (a
request it cannot parse) in OpenAI's error shape, and WebSocket upgrades refused in that shape.

Timeouts bound how long a client may take to *send*; a response (a long stream) is never cut:
- keep_alive: a connection idle before its first request, or after a response, closes silently;
- header: a request line and headers not complete this long after the connection opened (or
  after the previous response) get a 408;
- body: a body not complete `body` seconds after its headers, plus one second per MIN_BODY_RATE
  bytes received, gets a 408 (a dribbling client is cut, a slow but steady upload is not).
"""

from __future__ import annotations

import http
import json
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.connections import ConnectionTable, over_limit_app
from server.errors import error_body

DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5.0  # uvicorn's default
DEFAULT_TIMEOUT_HEADER_S = 10.0
DEFAULT_TIMEOUT_BODY_S = 30.0
MIN_BODY_RATE = 16 << 10  # bytes per second that earn a body one more second

HEAD, BODY = "head", "body"  # what a connection is waiting for from its client


@dataclass(frozen=True)
class ReadTimeouts:
    keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE_S
    header: float = DEFAULT_TIMEOUT_HEADER_S
    body: float = DEFAULT_TIMEOUT_BODY_S


def json_error_bytes(status: int, reason: bytes, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 error response that closes the connection, for when no request (or no
    h11 state) is there to answer through."""
    body = json.dumps(error_body(status, message, code=code)).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, reason, len(body))) + body


class HTTPProtocol(H11Protocol):
    def __init__(self, config, server_state, app_state, _loop=None, *, timeouts: ReadTimeouts,
                 table: ConnectionTable):
        super().__init__(config, server_state, app_state, _loop)
        self.timeouts, self.table = timeouts, table
        self.over_limit = False  # accepted past --limit-connections: set by the listener
        self.evicted = False  # closed by us to make room for a newer connection
        self._waiting: str | None = None  # HEAD, BODY or None (a request is being answered)
        self._since = 0.0
        self._bytes = 0  # received since `_since`
        self._timer = None

    # ------------------------------------------------------------------ connection
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if self.over_limit:
            self.app = over_limit_app(self.app, self.table.limit)
        self._watch()

    def connection_lost(self, exc) -> None:
        self._set_waiting(None)
        self.table.closed(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._bytes += len(data)
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def close_idle(self) -> bool:
        """Close this connection if it has no request under way (to make room); True if it did."""
        if self._waiting != HEAD or self.transport.is_closing():
            return False
        self.evicted = True
        self.transport.close()
        return True

    # ------------------------------------------------------------------ read timeouts
    def _watch(self) -> None:
        """Follow what the connection waits for from its client; a change restarts the clock."""
        waiting = None
        if not self.transport.is_closing():
            state = self.conn.their_state
            waiting = HEAD if state is h11.IDLE else BODY if state is h11.SEND_BODY else None
        if waiting != self._waiting:
            self._set_waiting(waiting)

    def _set_waiting(self, waiting: str | None) -> None:
        self._waiting, self._since, self._bytes = waiting, self.loop.time(), 0
        self.table.set_idle(self, waiting == HEAD)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if waiting is not None:
            self._timer = self.loop.call_at(self._deadline(), self._on_deadline)

    def _deadline(self) -> float:
        t = self.timeouts
        if self._waiting == HEAD:
            return self._since + (t.header if self._bytes else min(t.keep_alive, t.header))
        return self._since + t.body + self._bytes / MIN_BODY_RATE

    def _on_deadline(self) -> None:
        self._timer = None
        self._watch()
        if self._waiting is None or self._timer is not None:
            return  # the connection moved on (a new clock started) or closed
        if self.loop.time() < self._deadline():  # bytes arrived meanwhile: more time
            self._timer = self.loop.call_at(self._deadline(), self._on_deadline)
            return
        if self._waiting == HEAD and not self._bytes:
            self.transport.close()  # idle: closed silently, as a keep-alive connection is
        elif self.cycle is not None and self.cycle.response_started:
            self.transport.close()  # answered (early, e.g. a 413) before the body was in: nothing more to say
        else:
            part = "headers" if self._waiting == HEAD else "body"
            limit = self.timeouts.header if self._waiting == HEAD else self.timeouts.body
            self.table.log.warning("timeout", "closing a connection whose request %s did not arrive in time", part)
            self.transport.write(json_error_bytes(
                408, b"Request Timeout", f"the request {part} did not arrive within {limit:g}s: send the whole "
                f"request promptly", "request_timeout"))
            self.transport.close()
        if self.cycle is not None:  # the app, if it waits for the body, hears a disconnect
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self._set_waiting(None)

    # ------------------------------------------------------------------ errors and upgrades
    def send_400_response(self, msg: str) -> None:
        self._send_error(400, f"malformed HTTP request: {msg}", "bad_http_request")

    def _should_upgrade_to_ws(self) -> bool:
        return True  # every WebSocket upgrade reaches handle_websocket_upgrade, which refuses it

    def _unsupported_upgrade_warning(self) -> None:
        pass  # another upgrade (h2c) is ignored and the request served, as HTTP/1.1 allows

    def handle_websocket_upgrade(self, event) -> None:
        self._send_error(400, "this server does not accept WebSocket connections: send HTTP requests (for "
                              "streaming, POST with \"stream\": true to receive server-sent events)",
                         "websocket_not_supported")

    def _send_error(self, status: int, message: str, code: str) -> None:
        body = json.dumps(error_body(status, message, code=code)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        reason = http.HTTPStatus(status).phrase.encode()
        for event in (h11.Response(status_code=status, headers=headers, reason=reason), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
