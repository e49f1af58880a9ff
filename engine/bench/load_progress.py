"""The live line of `engine bench serve`: requests sent, in flight and finished, and the tokens
streamed per second, refreshed every second from the start, so that a queue that has not yet
finished a request reads as work under way rather than as a hang."""

from __future__ import annotations

import asyncio
import time

REFRESH_S = 1.0


class LoadProgress:
    """Counts what the load generator does; `bar` is a tqdm bar over the requests (finished ones)."""

    def __init__(self, bar):
        self.bar = bar
        self.sent = self.finished = self.failed = self.tokens = 0
        self.start = time.perf_counter()
        self._task: asyncio.Task | None = None

    def on_sent(self) -> None:
        self.sent += 1

    def on_token(self) -> None:
        """One choice-carrying chunk arrived (one token for a server that streams token by token)."""
        self.tokens += 1

    def on_finished(self, success: bool) -> None:
        self.finished += 1
        self.failed += not success
        self.bar.update(1)

    def line(self) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        failed = f", {self.failed} failed" if self.failed else ""
        return (f"sent {self.sent}, in flight {self.sent - self.finished}, done {self.finished}{failed}, "
                f"{self.tokens / elapsed:,.0f} tok/s")

    def _show(self) -> None:
        self.bar.set_postfix_str(self.line(), refresh=True)

    async def _refresh(self) -> None:
        while True:
            self._show()
            await asyncio.sleep(REFRESH_S)

    def __enter__(self) -> "LoadProgress":
        self._task = asyncio.get_running_loop().create_task(self._refresh())
        return self

    def __exit__(self, *exc) -> None:
        if self._task is not None:
            self._task.cancel()
        self._show()
        self.bar.close()
