"""Compiled grammars for one vocabulary: compiled on a small thread pool (xgrammar releases the GIL
while it compiles, so the event loop and the engine step go on), at most once per spec at a time,
kept in a least-recently-used cache bounded in bytes, each compile bounded in time.

The server waits, off its event loop, for a request's grammar before it queues the request, so the
step that first samples it finds the grammar compiled. Where the sampling rank is another process
(pipeline stages, data-parallel replicas) the front has no store: that rank's admission starts the
compile and its first sampling step waits for what is left of it."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading

from engine.sampling_params import GrammarSpec, UnsatisfiableRequestError
from engine.structured_output.closing import string_chars
from engine.structured_output.grammar import to_grammar, xgrammar

COMPILE_THREADS = 2


class GrammarStore:
    def __init__(self, tokenizer_info, cache_bytes: int, compile_timeout_s: float, json_value_limits: bool):
        self.compiler = xgrammar().GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)
        self.cache_bytes = cache_bytes
        self.compile_timeout_s = compile_timeout_s
        self.json_value_limits = json_value_limits
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple, object] = collections.OrderedDict()
        self._cached_bytes = 0
        self._compiling: dict[tuple, concurrent.futures.Future] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="pagewise-grammar")

    def key(self, spec: GrammarSpec, max_tokens: int | None) -> tuple:
        """What a compiled grammar depends on: the spec (not where it starts) and, for JSON, the
        closing bounds."""
        bounded = self.json_value_limits and spec.kind in ("json", "json_object")
        return dataclasses.replace(spec, reasoning_end=""), string_chars(max_tokens) if bounded else None

    def start(self, spec: GrammarSpec, max_tokens: int | None) -> concurrent.futures.Future:
        """A future of the compiled grammar: done if cached, else compiling (started once per key)."""
        key = self.key(spec, max_tokens)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                done = concurrent.futures.Future()
                done.set_result(self._cache[key])
                return done
            future = self._compiling.get(key)
            if future is None:
                future = self._compiling[key] = self._pool.submit(self._compile, key)
            return future

    def compiled(self, spec: GrammarSpec, max_tokens: int | None):
        """The compiled grammar, waiting at most compile_timeout_s for it; past that the request is
        refused as too complex (UnsatisfiableRequestError, the client's 400) and a compile not yet
        started is dropped."""
        future = self.start(spec, max_tokens)
        try:
            return future.result(timeout=self.compile_timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise UnsatisfiableRequestError(
                "structured_outputs", f": the {spec.kind} did not compile within {self.compile_timeout_s:g} s "
                "(grammar_compile_timeout_s): it is too complex; simplify it (fewer alternatives, shorter "
                "repetitions)") from None

    def _compile(self, key: tuple):
        spec, chars = key
        try:
            compiled = self.compiler.compile_grammar(to_grammar(spec, chars))
        finally:
            with self._lock:
                self._compiling.pop(key, None)
        with self._lock:
            self._cache[key] = compiled
            self._cached_bytes += compiled.memory_size_bytes
            while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cached_bytes -= old.memory_size_bytes
        return compiled

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def cached_keys(self) -> list[tuple]:
        with self._lock:
            return list(self._cache)
