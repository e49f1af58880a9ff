"""AsyncEngine: one background thread drives EngineCore.step(); each request gets an async stream.

EngineCore is not thread-safe, so the engine thread is the only one that steps it. The
asyncio side never changes the core: `generate()` runs the request's one admission check (the
core's check_request reads only what the core fixed at start), then `generate()` and `abort()`
append commands to a queue that the engine thread applies between steps, and the engine thread
hands each step's outputs back to the event loop with one `call_soon_threadsafe`. Every request
shares the continuous batch; nothing here serializes generation.

The engine thread also runs the OutputProcessor right after each step (detokenizing, stop
strings, which then end their choices in the core before the next step). A streamed request's
outputs are deltas, merged while its consumer has not taken them, so a slow consumer sees fewer,
larger updates instead of a growing backlog; a whole one (delta=False) gets one output at its end.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import copy
import logging
import threading
import time
from typing import AsyncIterator, Callable

from engine import structured_output
from engine.config import EngineConfig
from engine.core.interface import CoreClient
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.request_stream import RequestStream
from engine.loading.sampling_defaults import SamplingDefaults
from engine.outputs import RequestOutput
from engine.request import LoRARequest
from engine.sampling_params import PARAM_NAMES, RequestError, SamplingParams

logger = logging.getLogger("pagewise.async_engine")

# How often an idle engine loop asks a parallel core whether its workers still live (a look at
# process states: microseconds).
IDLE_HEALTH_CHECK_S = 1.0
# Requests with a grammar are checked off the event loop, each waiting up to grammar_compile_timeout_s
# for its compile; a few at a time, so that they never take the threads a server tokenizes with.
_GRAMMAR_CHECKS = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="pagewise-grammar-check")


class EngineDeadError(RuntimeError):
    """The engine loop stopped (a failed step or a failed start); no request can be served."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full: the request was not admitted (HTTP 503, retry later)."""


class EngineShuttingDownError(EngineOverloadedError):
    """The engine is draining for shutdown and admits nothing new."""


class RequestFailedError(RuntimeError):
    """Processing this one request failed inside the engine (HTTP 500); the engine serves on."""


class RequestInvalidError(RequestError):
    """This request's own parameters asked for the impossible partway through (say, a grammar and
    allowed_token_ids that leave no token): it ended there (HTTP 400); the engine serves on. Built
    from the core's message, an UnsatisfiableRequestError's text, whose first word is the field."""

    def __init__(self, message: str):
        name = message.partition(":")[0]
        field = name if name in PARAM_NAMES else ""  # only a SamplingParams field counts as one
        super().__init__(field, message[len(field):])


class AsyncEngine:
    """The async face of one engine: generate / abort / stats / check_health / start / shutdown."""

    def __init__(self, config: EngineConfig, core_factory: Callable[[EngineConfig], CoreClient] | None = None):
        self.config = config.for_serving()
        self._core_factory = core_factory or _default_core_factory
        self._core: CoreClient | None = None  # touched only by the engine thread (and read-only attributes at start)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._commands: collections.deque = collections.deque()  # appended here, drained by the thread
        self._wake = threading.Event()
        self._stop = False
        self._streams: dict[str, RequestStream] = {}  # event-loop side only
        # Admission bookkeeping shared with the engine thread (under _lock): the core's stats as of
        # its last refresh, and the requests admitted since, which those stats do not show yet.
        self._lock = threading.Lock()
        self._pending = _Pending()
        self._core_stats: dict = {}
        self._handed: list[_Admission] = []  # engine thread only: handed to the core since the last refresh
        self._counters = {"num_requests_admitted": 0, "num_requests_rejected": 0, "num_requests_aborted": 0,
                          "num_requests_failed": 0}
        self._shutdown_task: asyncio.Future | None = None
        self._dead: BaseException | None = None
        self._death_callbacks: list[Callable[[BaseException], object]] = []
        # Filled in by start() from the core.
        self.tokenizer = None
        self.model_name: str = ""
        self.max_model_len: int = 0
        self.sampling_defaults = SamplingDefaults()

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Build the core in the engine thread (weights load there) and start stepping."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        ready: asyncio.Future = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="pagewise-engine", daemon=True)
        self._thread.start()
        await ready  # raises whatever the core's constructor raised

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop admitting, let running requests finish for up to `timeout` seconds, abort the rest,
        stop the engine thread. Safe to call more than once (a signal and the app's lifespan
        both call it): every caller waits for the same shutdown."""
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.ensure_future(self._shutdown(timeout))
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._streams and self._dead is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._streams:
            logger.warning("shutdown: aborting %d unfinished request(s) after %.1fs", len(self._streams), timeout)
        for request_id in list(self._streams):
            self.abort(request_id)  # the engine thread hands each its last output as it stops
        self._stop = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            await asyncio.to_thread(self._thread.join, 30.0)
        for stream in list(self._streams.values()):  # the engine thread could not: still a final event
            stream.put(stream.abort_output())

    @property
    def died(self) -> BaseException | None:
        """What stopped the engine loop (a failed forward, a dead worker), or None."""
        return self._dead

    def on_death(self, callback: Callable[[BaseException], object]) -> None:
        """Call `callback(cause)` on the event loop once the engine loop has died (the server
        uses it to exit, so that a supervisor restarts it)."""
        self._death_callbacks.append(callback)

    @property
    def is_healthy(self) -> bool:
        try:
            self.check_health()
        except EngineDeadError:
            return False
        return True

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine loop stopped: {type(self._dead).__name__}: {self._dead}")
        if self._thread is None or not self._thread.is_alive() or self._stop or self._core is None:
            raise EngineDeadError("engine is not running")  # a None core: the engine thread still builds it
        try:  # a parallel core's worker or replica process may die while the loop idles
            self._core.check_health()
        except Exception as e:
            raise EngineDeadError(str(e)) from e

    # ----------------------------------------------------------------- requests
    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       prompt: str | None = None, delta: bool = True,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutput deltas until the request finishes; with delta=False, yield the one
        whole output when it finishes (what a non-streamed response needs, built once).

        Raises (on the first iteration) a RequestError naming the field when the request cannot
        be served as asked, EngineOverloadedError when the waiting queue is full, EngineDeadError
        when the loop died. Closing the iterator early aborts the request and frees its blocks.
        """
        arrival_time = time.perf_counter()
        await self._check(prompt_token_ids, sampling_params, lora_request)
        stream, admission = self._admit(request_id, prompt_token_ids, prompt, sampling_params.n)
        self._commands.append(("add", request_id, prompt_token_ids, sampling_params, prompt, admission,
                               delta, arrival_time, lora_request))
        self._wake.set()
        if self.config.log_requests:
            logger.info("request %s: prompt=%r token_ids=%s params=%s", request_id, prompt,
                        prompt_token_ids, sampling_params)
        texts: dict[int, list[str]] | None = {} if self.config.log_requests else None  # only to log them
        try:
            while True:
                output = await stream.get()
                if texts is not None:
                    for c in output.outputs:
                        texts.setdefault(c.index, []).append(c.text)
                    if output.finished:
                        logger.info("request %s finished: %s", request_id,
                                    {i: "".join(pieces) for i, pieces in sorted(texts.items())})
                yield output
                if output.finished:
                    return
        finally:
            if not stream.finished:
                self.abort(request_id)  # the consumer went away (disconnect, cancel, error)
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]

    def abort(self, request_id: str | list[str]) -> None:
        """Abort now: the engine thread frees the blocks before its next step."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._counters["num_requests_aborted"] += len(ids)
        self._commands.append(("abort", ids))
        self._wake.set()

    async def _check(self, prompt_token_ids: list[int], params: SamplingParams,
                     lora_request: LoRARequest | None = None) -> None:
        """The request's one admission check (a RequestError naming the field), on the event loop
        except for a request with a grammar: its bounds, the core's checks and its compile run on
        a checker thread, and the request waits there so that it enters the core with its grammar
        ready. The core's checks read only what it fixed at start, so no thread races the engine's."""
        self._check_open()
        if params.structured_outputs is None:
            self._core.check_request(prompt_token_ids, params, lora_request)
            return
        await asyncio.get_running_loop().run_in_executor(_GRAMMAR_CHECKS, self._check_with_grammar,
                                                         prompt_token_ids, params, lora_request)

    def check_lora(self, lora_request: LoRARequest) -> None:
        """A RequestError naming lora_request unless the engine can serve this adapter (reads its
        folder: call it off the event loop)."""
        self.check_health()
        self._core.check_lora(lora_request)

    def _check_open(self) -> None:
        if self._shutdown_task is not None and self._dead is None:
            self._counters["num_requests_rejected"] += 1
            raise EngineShuttingDownError("server is shutting down")
        self.check_health()

    def _check_with_grammar(self, prompt_token_ids: list[int], params: SamplingParams,
                            lora_request: LoRARequest | None) -> None:
        spec = params.structured_outputs
        structured_output.check_bounds(spec, self.config)
        self._core.check_request(prompt_token_ids, params, lora_request)
        structured_output.wait_compiled(spec, params.max_tokens)

    def _admit(self, request_id: str, prompt_token_ids: list[int], prompt: str | None,
               num_seqs: int) -> tuple[RequestStream, _Admission]:
        self._check_open()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        admission = _Admission(num_seqs, -(-(len(prompt_token_ids) + 1) // self.config.block_size))
        with self._lock:
            admission.starts = self._starts_now_locked(admission)
            limit = self.config.max_waiting_requests
            if not admission.starts and limit is not None and self._num_waiting_locked() + num_seqs > limit:
                self._counters["num_requests_rejected"] += 1
                raise EngineOverloadedError(
                    f"too many waiting sequences (max_waiting_requests={limit}, each of a request's n choices "
                    "counts, and a request waits while the sequences, tokens or KV cache blocks it needs are taken)")
            self._pending.add(admission, +1)
        self._counters["num_requests_admitted"] += 1
        stream = self._streams[request_id] = RequestStream(request_id, prompt_token_ids, prompt, num_seqs)
        return stream, admission

    def _num_waiting_locked(self) -> int:
        """Sequences that cannot run now: the core's waiting ones (queued behind the sequence
        budget, the KV cache, the token budget, or preempted) and those admitted since its stats
        that found no room."""
        s = self._core_stats
        return s.get("num_waiting_seqs", s.get("num_waiting", 0)) + self._pending.waiting_seqs

    def _starts_now_locked(self, admission: _Admission) -> bool:
        """Whether this request finds room at once: nothing waits ahead of it (first come, first
        served), and the sequence slots and the KV blocks its prompt needs are free, net of those
        that requests admitted since the core's stats will take."""
        s = self._core_stats
        if self._num_waiting_locked() > 0:
            return False
        slots = self.config.max_num_seqs * self.config.data_parallel_size
        free_slots = slots - s.get("num_running_seqs", s.get("num_running", 0)) - self._pending.starting_seqs
        free_blocks = (s.get("num_total_blocks", 0) - s.get("num_used_blocks", 0) - self._pending.starting_blocks)
        return admission.num_seqs <= free_slots and admission.num_blocks <= free_blocks

    @property
    def max_admissible_seqs(self) -> int | None:
        """The most sequences (prompts x n) one request can ever be admitted with."""
        limit = self.config.max_waiting_requests
        return None if limit is None else self.config.max_num_seqs + limit

    # ----------------------------------------------------------------- stats
    def stats(self) -> dict:
        """The core's stats as of its last change, plus this engine's own counters."""
        with self._lock:
            stats = dict(self._core_stats)
            pending = self._pending.seqs
        stats["num_waiting"] = stats.get("num_waiting", 0) + pending  # not-yet-handed-over sequences wait too
        stats["num_pending"] = pending
        stats.update(self._counters)
        stats["healthy"] = self.is_healthy
        return stats

    # ----------------------------------------------------------------- engine thread
    def _run(self, ready: asyncio.Future) -> None:
        try:
            core = self._core = self._core_factory(self.config)
            processor = OutputProcessor(core.tokenizer)  # the engine thread's, like the core
            self.model_name = core.model_name
            self.max_model_len = core.max_model_len
            self.sampling_defaults = core.sampling_defaults
            self.tokenizer = _private_copy(core.tokenizer)
            self._refresh(core)
        except BaseException as e:  # a failed start is reported to start()'s caller
            self._dead = e
            self._post(lambda e=e: ready.done() or ready.set_exception(e))  # bind e: `except` unbinds it
            return
        self._post(lambda: ready.done() or ready.set_result(None))
        try:
            while not self._stop:
                self._wake.clear()  # cleared before draining, so a command added now re-wakes us
                self._apply_commands(core, processor)
                if core.has_unfinished_requests():
                    outputs, stops = processor.process(core.step())
                    for stop in stops:  # ended by a stop string: free its blocks before the next step
                        core.finish_choice(stop.request_id, stop.index, stop.stop)
                    self._refresh(core)
                    if outputs:
                        self._post(lambda outs=outputs: self._deliver(outs))
                # A parallel core's worker or replica may die while nothing runs: looked at while idle,
                # so that its death stops the loop (and the server, for its supervisor to restart) then,
                # not only when the next request's step fails.
                elif not self._wake.wait(IDLE_HEALTH_CHECK_S):
                    core.check_health()  # raises WorkerDiedError: the loop dies below, as if a step had failed
            self._apply_commands(core, processor)  # stopping: still free the blocks of the last aborts
        except BaseException as e:
            logger.exception("engine loop died; failing all pending requests")
            self._dead = e
            self._post(lambda e=e: self._fail_all(e))
        finally:  # a parallel core's worker or replica processes end with the loop, however it ended
            core.shutdown()

    def _refresh(self, core: CoreClient) -> None:
        """Take the core's stats; the requests handed to it before now are in them."""
        with self._lock:
            self._core_stats = core.stats()
            for admission in self._handed:
                self._pending.add(admission, -1)
        self._handed = []

    def _apply_commands(self, core: CoreClient, processor: OutputProcessor) -> None:
        rejected = []
        aborted = False
        while self._commands:
            command = self._commands.popleft()
            if command[0] == "add":
                _, request_id, prompt_token_ids, params, prompt, admission, delta, arrival_time, lora = command
                self._handed.append(admission)  # counted as pending until the stats after a step show it
                try:
                    core.add_request(request_id, prompt_token_ids, params, lora_request=lora)
                    processor.add_request(request_id, prompt, prompt_token_ids, params, delta, arrival_time)
                except ValueError as e:  # a request id in use: the caller's fault, not the engine's
                    rejected.append((request_id, e))
                except Exception as e:  # a bug for this one request: report it, keep serving the rest
                    logger.exception("add_request failed for request %s", request_id)
                    rejected.append((request_id, RuntimeError(f"internal error: {type(e).__name__}")))
            else:
                aborted = True
                core.abort_request(command[1])
                ended = [out for out in map(processor.abort, command[1]) if out is not None]
                if ended:  # a stream still read (shutdown) gets its last output; others are gone
                    self._post(lambda outs=ended: self._deliver(outs))
        # Refreshed now only when aborts freed room (or nothing will step): the stats taken before a
        # step's schedule would show every request just added as waiting, even one about to start.
        if aborted or rejected or not core.has_unfinished_requests():
            self._refresh(core)
        if rejected:
            self._post(lambda: [self._fail(rid, e) for rid, e in rejected])

    def _post(self, callback: Callable[[], object]) -> None:
        try:
            self._loop.call_soon_threadsafe(callback)
        except RuntimeError:  # the event loop is closed: nobody is left to tell
            pass

    # ----------------------------------------------------------------- event-loop side
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.error is not None and output.invalid_request:  # the client's to change
                stream.fail(RequestInvalidError(output.error))
            elif output.error is not None:  # the core failed this request alone
                self._counters["num_requests_failed"] += 1
                stream.fail(RequestFailedError(output.error))
            else:
                stream.put(output)

    def _fail(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.fail(error)

    def _fail_all(self, cause: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            self._counters["num_requests_failed"] += 1
            stream.fail(EngineDeadError(f"engine loop stopped: {type(cause).__name__}"))
        for callback in self._death_callbacks:
            try:
                callback(cause)
            except Exception:
                logger.exception("engine death callback failed")


class _Admission:
    """What admission knew of one request: its sequences, the KV blocks its prompt needs, and
    whether it found room to start at once."""

    __slots__ = ("num_seqs", "num_blocks", "starts")

    def __init__(self, num_seqs: int, num_blocks: int):
        self.num_seqs, self.num_blocks, self.starts = num_seqs, num_blocks, False


class _Pending:
    """Sums over the requests admitted since the core's stats were taken (under AsyncEngine._lock)."""

    def __init__(self):
        self.seqs = self.waiting_seqs = self.starting_seqs = self.starting_blocks = 0

    def add(self, admission: _Admission, sign: int) -> None:
        self.seqs += sign * admission.num_seqs
        if admission.starts:
            self.starting_seqs += sign * admission.num_seqs
            self.starting_blocks += sign * admission.num_blocks
        else:
            self.waiting_seqs += sign * admission.num_seqs


def _default_core_factory(config: EngineConfig) -> CoreClient:
    from engine.frontend.core_factory import start_core

    return start_core(config)


def _private_copy(tokenizer):
    """A copy of the tokenizer for the event-loop thread: fast tokenizers must not be shared
    across threads (concurrent calls can fail with 'Already borrowed')."""
    if tokenizer is None:
        return None
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # not copyable: share it; the server only encodes and decodes
        return tokenizer
