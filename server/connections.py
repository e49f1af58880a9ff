"""The connection cap: our own listener accepts at most `limit` connections (plus a few spare,
answered 503), closes the oldest idle ones to make room for new ones, and so never runs the
process out of file descriptors, however many silent connections a client opens."""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import socket
import time
from collections import OrderedDict

from server.errors import error_response

logger = logging.getLogger("pagewise.server")

# Connections accepted past the limit when no idle one can be closed: they get a 503 (or /health).
SPARE_CONNECTIONS = 32
# Descriptors the process keeps for itself (model files, pipes, logs) besides the connections.
RESERVED_FDS = 96
# Past this many connections memory, not descriptors, is what runs out.
MAX_DEFAULT_CONNECTIONS = 8192
ACCEPT_BATCH = 64  # accepted per wake-up, so one flood cannot starve the event loop
EMFILE_RETRY_S = 0.1


def raise_open_files_limit() -> int:
    """Raise this process's open-files soft limit to its hard limit, as nginx and Go do; the
    limit in effect."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # An unlimited hard limit (macOS) still has a per-process cap; this much is plenty.
    wanted = 1 << 16 if hard == resource.RLIM_INFINITY else hard
    if soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            pass
    return soft


def connection_limit(requested: int | None, open_files: int) -> int:
    """--limit-connections, checked against the open-files limit (default: what fits under it)."""
    room = open_files - RESERVED_FDS - SPARE_CONNECTIONS
    if requested is None:
        if room < 16:
            raise ValueError(f"the open-files limit ({open_files}) leaves no room for connections: raise it "
                             f"(ulimit -n {RESERVED_FDS + SPARE_CONNECTIONS + 1024})")
        return min(room, MAX_DEFAULT_CONNECTIONS)
    if requested < 1:
        raise ValueError(f"--limit-connections must be at least 1, got {requested}")
    if requested > room:
        raise ValueError(f"--limit-connections {requested} does not fit the open-files limit of {open_files} "
                         f"(the server keeps {RESERVED_FDS + SPARE_CONNECTIONS} for itself): pass at most {room}, "
                         f"or raise the limit (ulimit -n)")
    return requested


class LogLimiter:
    """At most one log line per `interval` seconds per key, counting the ones it held back."""

    def __init__(self, interval: float = 1.0):
        self.interval = interval
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, key: str, message: str, *args) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -self.interval) < self.interval:
            self._held[key] = self._held.get(key, 0) + 1
            return
        held = self._held.pop(key, 0)
        self._last[key] = now
        logger.warning(message + (f" (and {held} more like it)" if held else ""), *args)


class ConnectionTable:
    """Every open connection, the idle ones (no request under way) oldest first."""

    def __init__(self, limit: int):
        self.limit = limit
        self.open = 0  # accepted and not yet closed: each holds a descriptor
        self.closing = 0  # closed by us to make room, descriptor not yet freed
        self.idle: OrderedDict[object, None] = OrderedDict()
        self.log = LogLimiter()
        self._on_room: list = []  # resume callbacks of listeners paused at the ceiling

    @property
    def ceiling(self) -> int:
        return self.limit + SPARE_CONNECTIONS

    def make_room(self) -> bool:
        """True when a new connection fits under the limit, closing the oldest idle one if need be."""
        if self.open - self.closing < self.limit:
            return True
        while self.idle:
            protocol, _ = self.idle.popitem(last=False)
            if protocol.close_idle():
                self.closing += 1
                self.log.warning("evict", "%d connections open (--limit-connections): closing idle ones "
                                 "to make room", self.limit)
                return True
        return False

    def wait_for_room(self, resume) -> None:
        """Call `resume()` once a connection closes below the ceiling."""
        self._on_room.append(resume)

    def set_idle(self, protocol, idle: bool) -> None:
        if idle:
            self.idle[protocol] = None
        else:
            self.idle.pop(protocol, None)

    def closed(self, protocol) -> None:
        self.idle.pop(protocol, None)
        self.open -= 1
        if protocol.evicted:
            self.closing -= 1
        if self._on_room and self.open < self.ceiling:
            for resume in self._on_room:
                resume()
            self._on_room.clear()


class Listener:
    """Accepts on one listening socket within the table's ceiling; what uvicorn's Server keeps
    in `servers` (sockets, close, wait_closed) in place of an asyncio.Server."""

    def __init__(self, sock: socket.socket, protocol_factory, table: ConnectionTable, backlog: int):
        self.loop = asyncio.get_running_loop()
        self.sock, self.protocol_factory, self.table = sock, protocol_factory, table
        self.sockets = [sock]
        self._reading = False
        sock.setblocking(False)
        sock.listen(backlog)
        self._resume()

    def _resume(self) -> None:
        if not self._reading and self.sock.fileno() != -1:
            self._reading = True
            self.loop.add_reader(self.sock.fileno(), self._accept)

    def _pause(self) -> None:
        if self._reading:
            self._reading = False
            self.loop.remove_reader(self.sock.fileno())

    def _accept(self) -> None:
        table = self.table
        for _ in range(ACCEPT_BATCH):
            if table.open >= table.ceiling:
                self._pause()
                table.wait_for_room(self._resume)
                table.log.warning("ceiling", "%d connections open (--limit-connections and %d spare): new ones "
                                  "wait in the kernel's queue until some close", table.open, SPARE_CONNECTIONS)
                return
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as e:  # out of descriptors or memory, or a connection reset while queued
                table.log.warning("accept", "cannot accept a connection (%s): retrying", e.strerror)
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause()
                    self.loop.call_later(EMFILE_RETRY_S, self._resume)
                return
            conn.setblocking(False)
            over = not table.make_room()
            table.open += 1
            if over:
                table.log.warning("over", "%d connections open, every one busy (--limit-connections): answering "
                                  "new ones 503", table.open)
            self.loop.create_task(self._connect(conn, over))

    async def _connect(self, conn: socket.socket, over: bool) -> None:
        protocol = self.protocol_factory()
        protocol.over_limit = over
        try:
            await self.loop.connect_accepted_socket(lambda: protocol, sock=conn)
        except OSError:  # the client left before the transport was made
            conn.close()
            self.table.open -= 1

    def close(self) -> None:
        self._pause()
        self.sock.close()

    async def wait_closed(self) -> None:
        pass


def over_limit_app(app, limit: int):
    """The app a connection past the limit gets: /health as usual, anything else a 503; either way
    the connection closes after its one response."""

    async def refuse(scope, receive, send):
        async def closing(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        if scope["type"] == "http" and scope["path"] == "/health":
            return await app(scope, receive, closing)
        response = error_response(503, f"the server has its limit of {limit} connections open "
                                       "(--limit-connections): retry shortly", code="too_many_connections",
                                  headers={"Retry-After": "1"})
        await response(scope, receive, closing)

    return refuse
