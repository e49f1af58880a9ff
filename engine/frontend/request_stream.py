"""One request's outputs on their way from the engine thread to the event loop: the deltas its
consumer has not taken yet, merged into one, or the error that ended it."""

from __future__ import annotations

import asyncio

from engine.outputs import CompletionOutput, RequestOutput


class RequestStream:
    """The outputs of one request not yet taken by its consumer (merged into one delta), handed
    from the engine thread to the event loop."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], prompt: str | None, num_choices: int):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.prompt = prompt
        self.finished = False  # a final output or an error was delivered
        self._unfinished = set(range(num_choices))  # choices whose finish the consumer has not been sent
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        if self.finished:
            return  # e.g. the core's own abort echo after we already closed the stream
        self._pending = output if self._pending is None else self._pending.merge(output)
        self._unfinished -= {c.index for c in output.outputs if c.finish_reason is not None}
        self.finished = output.finished
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        if self.finished:
            return
        self._error, self.finished = error, True
        self._ready.set()

    def abort_output(self) -> RequestOutput:
        """The final delta for a request ended from outside (shutdown): every choice that has
        not finished ends with finish_reason=abort."""
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [CompletionOutput(i, "", [], finish_reason="abort") for i in sorted(self._unfinished)],
                             finished=True)

    async def get(self) -> RequestOutput:
        while True:
            if self._pending is not None:
                output, self._pending = self._pending, None
                return output
            if self._error is not None:
                raise self._error
            self._ready.clear()
            await self._ready.wait()
