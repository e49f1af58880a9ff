"""Structured output: a grammar that the sampled tokens must follow, with xgrammar.

xgrammar (what vLLM and SGLang use) compiles a JSON schema, a regex, a choice list or an EBNF
grammar once into a token-level automaton, and answers, per step and per stream, which tokens
may come next as a bitmask over the vocabulary, in microseconds for JSON. Compiling is the
expensive part (seconds for a large enum), so it never runs on the server's event loop nor, where
the server and the sampling rank share a process, inside an engine step:

1. the server's edge: `check_bounds` (bounds.py) refuses a spec over the configured size, depth or
   value count before anything parses it;
2. every front's admission: `admit` refuses a spec that does not parse, refers outside itself, or
   could never close (finite.py), without the vocabulary (milliseconds), and, where this process
   samples and its grammars exist, starts compiling it on the store's threads (store.py);
3. the server waits off its event loop, bounded in time, for that compile (`wait_compiled`), so
   the request enters the engine with its grammar ready;
4. the sampling rank (matchers.py) makes each stream a matcher from the compiled grammar and masks
   the batch's logits; the runner advances each matcher with the token its stream took.

The sampling rank offers how to build its grammars (`offer_sampler`) at its first step, since
the vocabulary is its own. JSON is generated compact (no free whitespace between tokens): a model
may otherwise emit whitespace for as long as it likes, and small models do. Free JSON values get
bounds that let the output close (closing.py).
"""

from __future__ import annotations

import threading
from typing import Callable

from engine.sampling_params import GrammarSpec
from engine.structured_output.bounds import check_bounds
from engine.structured_output.grammar import INSTALL, check, to_grammar
from engine.structured_output.matchers import StructuredOutputs
from engine.structured_output.store import GrammarStore

__all__ = ["INSTALL", "GrammarStore", "Offer", "StructuredOutputs", "admit", "check", "check_bounds",
           "offer_sampler", "to_grammar", "wait_compiled"]


class Offer:
    """A sampling rank's grammars, built once, on first use, by whichever thread needs them first."""

    def __init__(self, build: Callable[[], StructuredOutputs]):
        self._build = build
        self._lock = threading.Lock()
        self.built: StructuredOutputs | None = None

    def grammars(self) -> StructuredOutputs:
        with self._lock:
            if self.built is None:
                self.built = self._build()
            return self.built


_offer: Offer | None = None  # the latest sampling rank of this process (one engine serves a server)


def offer_sampler(build: Callable[[], StructuredOutputs]) -> Offer:
    """Register this process's sampling rank: `build` makes its grammars (it must not hold the runner,
    which the registry would then keep alive)."""
    global _offer
    _offer = Offer(build)
    return _offer


def admit(spec: GrammarSpec, max_tokens: int | None) -> None:
    """`check` the spec; where this process samples and its grammars exist, start compiling it."""
    check(spec)
    offer = _offer
    if offer is not None and offer.built is not None:
        offer.built.store.start(spec, max_tokens)


def wait_compiled(spec: GrammarSpec, max_tokens: int | None) -> None:
    """Block (off the event loop) until the spec is compiled for this process's sampling rank, at most
    grammar_compile_timeout_s (then UnsatisfiableRequestError: too complex); nothing to wait for
    where the sampling rank is another process, or has not run a step yet."""
    offer = _offer
    if offer is not None:
        offer.grammars().store.compiled(spec, max_tokens)
