"""Helpers around engine streams: prime (surface errors before any byte is sent), merge several
streams into one, and abandon work when the HTTP client disconnects."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, TypeVar

from engine.outputs import RequestOutput

T = TypeVar("T")

DISCONNECT_POLL_S = 0.25


class ClientDisconnected(Exception):
    """The HTTP client went away; the request's engine work was cancelled (and aborted)."""


class Primed:
    """A stream whose first output is already in hand. aclose() closes the engine stream
    (aborting the request) even if iteration never started."""

    def __init__(self, first: RequestOutput, stream: AsyncIterator[RequestOutput]):
        self._first, self._stream = first, stream

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self._stream.__anext__()

    async def aclose(self) -> None:
        await self._stream.aclose()


async def primed(stream: AsyncIterator[RequestOutput]) -> Primed:
    """Wait for the first output, so admission errors (overload, a prompt the engine rejects)
    become an HTTP status instead of an error inside a 200 stream."""
    try:
        first = await stream.__anext__()
    except BaseException:
        await stream.aclose()
        raise
    return Primed(first, stream)


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from several streams as they arrive. Closing it closes them all."""
    if len(streams) == 1:
        try:
            async for output in streams[0]:
                yield 0, output
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, stream):
        try:
            async for output in stream:
                queue.put_nowait((i, output, None))
        except Exception as e:
            queue.put_nowait((i, None, e))
        finally:
            queue.put_nowait((i, done, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, output, error = await queue.get()
            if error is not None:
                raise error
            if output is done:
                remaining -= 1
            else:
                yield i, output
    finally:
        for task in tasks:
            task.cancel()  # cancels inside each stream, whose own cleanup aborts its request
        await asyncio.gather(*tasks, return_exceptions=True)


async def unless_disconnected(request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, but cancel it (so the engine aborts the request) if the client leaves.

    Starlette cancels streaming responses on disconnect by itself; a plain JSON endpoint is
    not cancelled, so it polls here."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def primed_all(streams: list[AsyncIterator[RequestOutput]]) -> list[Primed]:
    """Prime every stream; if one fails (or we are cancelled), close the rest and raise."""
    tasks = [asyncio.ensure_future(primed(s)) for s in streams]
    ok = False
    try:
        await asyncio.wait(tasks)
        errors = [t.exception() for t in tasks if t.exception() is not None]
        if errors:
            raise errors[0]
        ok = True
        return [t.result() for t in tasks]
    finally:
        if not ok:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for t in tasks:
                if not t.cancelled() and t.exception() is None:
                    await t.result().aclose()


async def last_outputs(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Each stream's last output (a whole one: the streams were started with delta=False); the first
    error is raised once all have ended."""
    results = await asyncio.gather(*(last_output(s) for s in streams), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


async def last_output(stream: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    last = None
    try:
        async for last in stream:
            pass
    finally:
        await stream.aclose()
    return last
