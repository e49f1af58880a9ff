"""A GrammarSpec as an xgrammar Grammar, and the admission check every front runs on it: nothing
here needs the model's vocabulary or compiles anything, so it costs milliseconds."""

from __future__ import annotations

import collections
import hashlib
import json
import re
import threading

from engine.sampling_params import GrammarSpec, RequestError
from engine.structured_output import closing, schema
from engine.structured_output.finite import rules_that_never_end

INSTALL = "pip install xgrammar"
_XGRAMMAR_SOURCE = re.compile(r"\[[\d:]+\] \S+\.(?:cc|h|cpp):\d+: ")
# Specs that passed the check, by digest (clients resend the same schema; every front checks each
# request, the server once more before it queues it); a bounded set of 32-byte keys.
_CHECKED_SIZE = 4096


def xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise RequestError("structured_outputs", f" needs the xgrammar package: {INSTALL}") from e
    return xgrammar


def to_grammar(spec: GrammarSpec, string_chars: int | None = None):
    """The spec as an xgrammar Grammar; `string_chars` set: a JSON one with the closing bounds
    (engine/structured_output/closing.py). Raises RequestError naming the field."""
    xgr = xgrammar()
    try:
        if spec.kind in ("json", "json_object"):
            # json_object: any object (strict_mode off lets it hold any property)
            value = json.loads(spec.spec) if spec.kind == "json" else {"type": "object"}
            if string_chars is not None:
                value = closing.bound_schema(value, string_chars)
            grammar = xgr.Grammar.from_json_schema(json.dumps(value), any_whitespace=False,
                                                   strict_mode=spec.strict and spec.kind == "json")
            if string_chars is not None:
                grammar = xgr.Grammar.from_ebnf(closing.bound_free_values(str(grammar), string_chars))
            return grammar
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.spec)
        if spec.kind == "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in json.loads(spec.spec)))
        return xgr.Grammar.from_ebnf(spec.spec)
    except UnicodeError:  # a lone surrogate escape: Python's codec text would say nothing to a client
        raise RequestError("structured_outputs", f": the {spec.kind} holds text that is not valid UTF-8 "
                         "(e.g. a lone \\ud800-\\udfff escape)") from None
    except Exception as e:  # xgrammar raises RuntimeError / InvalidJSONError with the parser's message
        why = _XGRAMMAR_SOURCE.sub("", str(e)).strip()  # its time and C++ source line say nothing to a client
        raise RequestError("structured_outputs", f": the {spec.kind} could not be compiled: {why}") from None


_checked: collections.OrderedDict[bytes, None] = collections.OrderedDict()
_checked_lock = threading.Lock()


def check(spec: GrammarSpec) -> None:
    """Refuse, as a RequestError naming `structured_outputs`, a spec that would not run as asked: one
    that does not parse, refers outside itself, combines keywords xgrammar does not enforce, or
    has a value it could never close (no finite output at all, or a definition that can only go on)."""
    digest = hashlib.sha256(f"{spec.kind}\0{spec.strict}\0{spec.spec}".encode()).digest()
    with _checked_lock:
        if digest in _checked:
            _checked.move_to_end(digest)
            return
    if spec.kind == "json":
        value = json.loads(spec.spec)
        if (ref := schema.external_ref(value)) is not None:
            raise RequestError("structured_outputs", f": the JSON schema refers outside itself ($ref {ref[:100]!r}); "
                             "only references inside it ('#/$defs/...') are followed: inline that definition")
        if (found := schema.unenforced(value)) is not None:
            raise RequestError("structured_outputs", f": the JSON schema has {found}, which is not enforced")
    never = rules_that_never_end(str(to_grammar(spec)))
    if never and never[0] == "root":
        raise RequestError("structured_outputs", f": the {spec.kind} admits no finite output (no value of it can "
                         "ever end): check it for a rule or $ref that only refers to itself, or definitions "
                         "that require each other")
    if never:
        raise RequestError("structured_outputs", f": the {spec.kind} has a part that can never end ({never[0]}: a rule "
                         "or definition that requires itself, directly or through another), so an output that "
                         "starts it runs until max_tokens: make that recursion optional")
    with _checked_lock:
        _checked[digest] = None
        if len(_checked) > _CHECKED_SIZE:
            _checked.popitem(last=False)
