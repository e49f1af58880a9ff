"""Structured output: a grammar that the sampled tokens must follow, with xgrammar.

xgrammar (what vLLM and SGLang use) compiles a JSON schema, a regex, a choice list or an EBNF
grammar once into a token-level automaton, and answers, per step and per stream, which tokens
may come next as a bitmask over the vocabulary, in microseconds for JSON. Here:

- `check` (the core's admission, before anything is queued) parses the spec without the model's
  tokenizer (over single bytes), so a bad schema or regex, or one that admits no output, is a
  ValueError naming `structured_outputs`;
- `StructuredOutputs` (held by the sampling rank's sampler) compiles each distinct spec once (a
  cache keyed by its text), gives each constrained stream its own matcher, and masks the batch's
  logits before sampling; the runner then advances each matcher with the token its stream took.

JSON is generated compact (no free whitespace between tokens): a model may otherwise emit
whitespace for as long as it likes, and small models do.
"""

from __future__ import annotations

import functools
import json
import re

import numpy as np
import torch

from engine.sampling_params import GrammarSpec

INSTALL = "pip install xgrammar"


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError(f"structured_outputs needs the xgrammar package: {INSTALL}") from e
    return xgrammar


def _grammar(xgr, spec: GrammarSpec):
    """The spec as an xgrammar Grammar (no tokenizer needed); raises ValueError naming the field."""
    try:
        if spec.kind == "json":
            return xgr.Grammar.from_json_schema(spec.spec, any_whitespace=False, strict_mode=spec.strict)
        if spec.kind == "json_object":
            return xgr.Grammar.builtin_json_grammar()
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.spec)
        if spec.kind == "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in json.loads(spec.spec)))
        return xgr.Grammar.from_ebnf(spec.spec)
    except Exception as e:  # xgrammar raises RuntimeError / InvalidJSONError with the parser's message
        why = _XGRAMMAR_SOURCE.sub("", str(e)).strip()  # its time and C++ source line say nothing to a client
        raise ValueError(f"structured_outputs: the {spec.kind} could not be compiled: {why}") from None


_XGRAMMAR_SOURCE = re.compile(r"\[[\d:]+\] \S+\.(?:cc|h|cpp):\d+: ")


def _unenforced(schema) -> str | None:
    """A keyword combination xgrammar accepts but does not enforce (found by the tests' jsonschema
    oracle): a string's pattern wins over its minLength / maxLength. Refused rather than ignored."""
    if isinstance(schema, dict):
        if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
            return "a string with both pattern and minLength/maxLength (put the length in the pattern, e.g. {2,4})"
        children = schema.values()
    elif isinstance(schema, list):
        children = schema
    else:
        return None
    return next((found for c in children if (found := _unenforced(c)) is not None), None)


@functools.cache
def _byte_compiler(xgr):
    """A compiler over a vocabulary of the 256 single bytes and an end token: every string is a
    sequence of its tokens, so a grammar that allows none of them first admits no output at all."""
    info = xgr.TokenizerInfo([bytes([b]) for b in range(256)] + [b"<end>"], stop_token_ids=[256])
    return xgr.GrammarCompiler(info, max_threads=1)


def _admits_nothing(xgr, grammar) -> bool:
    """Whether no string, the empty one included, follows the grammar (e.g. a JSON schema that only
    refers to itself, {"$ref": "#"}: xgrammar compiles it, and its first bitmask allows no token,
    so a stream could only sample a token its grammar forbids)."""
    matcher = xgr.GrammarMatcher(_byte_compiler(xgr).compile_grammar(grammar))
    bitmask = xgr.allocate_token_bitmask(1, 257)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return not bool(bitmask.any())


@functools.lru_cache(maxsize=1024)
def check(spec: GrammarSpec) -> None:
    """Parse the spec at admission, so that a bad one is refused before it reaches a step. Cached:
    a server checks each request twice (before queuing and in the core), and clients resend the
    same schema; a spec that fails raises again each time (exceptions are not cached)."""
    if spec.kind == "json" and (found := _unenforced(json.loads(spec.spec))) is not None:
        raise ValueError(f"structured_outputs: the JSON schema has {found}, which is not enforced")
    xgr = _xgrammar()
    if _admits_nothing(xgr, _grammar(xgr, spec)):
        raise ValueError(f"structured_outputs: the {spec.kind} admits no output at all (not even an empty one), "
                         f"so no token could be sampled: check it for a rule or $ref that only refers to itself")


class StructuredOutputs:
    """The sampling rank's grammars: compiled once per spec, one matcher per constrained stream."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], apply_bitmask):
        """`apply_bitmask`: the kernel backend's apply_token_bitmask (xgrammar's own CPU one took
        6.4 ms for 32 x 49,152 logits; the C++ one skips the words a grammar allows whole)."""
        xgr = _xgrammar()
        self.xgr = xgr
        self.apply_bitmask = apply_bitmask
        self.vocab_size = vocab_size
        self.end_token_ids = list(eos_token_ids)  # the tokens a grammar ends on
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._compiled: dict[GrammarSpec, object] = {}

    def matcher(self, spec: GrammarSpec, accepted: list[int]):
        """A fresh matcher for a stream, advanced over the tokens it already has."""
        compiled = self._compiled.get(spec)
        if compiled is None:
            compiled = self._compiled[spec] = self.compiler.compile_grammar(_grammar(self.xgr, spec))
        m = self.xgr.GrammarMatcher(compiled)
        for token in accepted:
            if not m.accept_token(token):
                raise ValueError("a stream's earlier tokens do not follow its grammar")
        return m

    def bitmask(self, num_rows: int, matchers: list, rows: list[int]) -> torch.Tensor:
        """int32 [num_rows, vocab / 32], bit t of row rows[i] set where `matchers[i]` allows token t
        next; other rows allow everything. Reads the matchers only: a retried batch masks the same way."""
        bitmask = self.xgr.allocate_token_bitmask(num_rows, self.vocab_size)  # all allowed
        for m, row in zip(matchers, rows):
            m.fill_next_token_bitmask(bitmask, row)
        return bitmask

    def only_ends(self, bitmask: torch.Tensor, row: int) -> bool:
        """Whether that row's grammar allows nothing but its end (an end token) next."""
        words = bitmask[row].numpy().view(np.uint32).copy()
        for t in self.end_token_ids:
            words[t >> 5] &= ~np.uint32(1 << (t & 31))
        return not words.any()

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Set to -inf, in place, every token the bitmask does not allow."""
        self.apply_bitmask(logits, bitmask.to(logits.device))
