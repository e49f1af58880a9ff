"""The uvicorn.Server that `engine serve` runs: it starts the engine before serving, accepts
connections through the connection table (server/connections.py) with the read timeouts of
server/http_protocol.py, and on SIGINT/SIGTERM drains the engine, then exits 0; a second
signal exits at once with 128 + its number (130, 143)."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import sys

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from server.connections import ConnectionTable, Listener
from server.http_protocol import HTTPProtocol, ReadTimeouts
from server.startup import StartupError

logger = logging.getLogger("pagewise.server")


class EngineServer(uvicorn.Server):
    """The engine starts here rather than in the app's lifespan (which calls start() again, a
    no-op): a bad model folder is then a StartupError (one line), not uvicorn's lifespan
    traceback. uvicorn waits for open connections before the lifespan shutdown runs, so a long
    stream could hold shutdown forever; draining from the signal lets running requests finish
    up to the timeout, then ends the rest with a final `abort` event."""

    def __init__(self, config: uvicorn.Config, engine, *, shutdown_timeout: float, user_errors: tuple,
                 timeouts: ReadTimeouts, table: ConnectionTable):
        super().__init__(config)
        self.engine, self.shutdown_timeout, self.user_errors = engine, shutdown_timeout, user_errors
        self.timeouts, self.table = timeouts, table
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None):
        try:
            await self.engine.start()
        except self.user_errors as e:
            raise StartupError(str(e)) from e
        try:
            await super().serve(sockets)
        finally:
            await self.engine.shutdown(self.shutdown_timeout)  # a no-op after the lifespan's own shutdown

    def handle_exit(self, sig, frame):
        if self.should_exit and self.engine.died is None:
            running = len(self.server_state.tasks)
            logger.warning("signal %d again: exiting now, cutting %d running request(s)", sig, running)
            os._exit(128 + sig)
        if self.loop is not None and not self.should_exit:
            logger.info("signal %d: draining for up to %.0fs, then stopping", sig, self.shutdown_timeout)
            self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.engine.shutdown(self.shutdown_timeout)))
        super().handle_exit(sig, frame)
        # uvicorn raises the signal again once stopped, which would end the process by it (143)
        # instead of serve()'s exit status: 0 after a drain, 1 when the engine died.
        self._captured_signals.clear()

    async def startup(self, sockets=None):
        """uvicorn's startup for the sockets we bound, accepting through our Listener."""
        loop = self.loop = asyncio.get_running_loop()
        loop.set_exception_handler(self._exception_handler)
        await self.lifespan.startup()
        if self.lifespan.should_exit:
            sys.exit(STARTUP_FAILURE)

        def protocol():
            return HTTPProtocol(self.config, self.server_state, self.lifespan.state, loop,
                                timeouts=self.timeouts, table=self.table)

        self.servers = [Listener(sock, protocol, self.table, self.config.backlog) for sock in sockets]
        self.started = True
        for sock in sockets:
            host, port = sock.getsockname()[:2]
            logger.info("pagewise listening on http://%s:%d", host, port)
        logger.info("at most %d connections open at once (--limit-connections)", self.table.limit)

    def _exception_handler(self, loop, context):
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
            self.table.log.warning("fds", "out of file descriptors: %s", context.get("message"))
            return
        loop.default_exception_handler(context)
