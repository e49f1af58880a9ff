"""The size a request's grammar may have, checked at the server's edge before anything parses or
compiles it: the cost of compiling grows faster than the spec (a 20,000-value enum takes seconds
and tens of MB), so each bound is a 400 that names it (an EngineConfig knob)."""

from __future__ import annotations

import json

from engine.sampling_params import GrammarSpec, RequestError
from engine.structured_output import schema


def check_bounds(spec: GrammarSpec, config) -> None:
    """RequestError naming `structured_outputs` and the bound the spec exceeds (`config`: an
    EngineConfig; grammar_max_bytes, grammar_max_depth, grammar_max_values)."""
    size = len(spec.spec.encode())
    if size > config.grammar_max_bytes:
        raise RequestError("structured_outputs", f": the {spec.kind} is {size} bytes, more than this server's "
                         f"grammar_max_bytes ({config.grammar_max_bytes}): send a smaller one")
    if spec.kind == "choice":
        count = len(json.loads(spec.spec))
        if count > config.grammar_max_values:
            raise RequestError("structured_outputs", f": choice lists {count} choices, more than this server's "
                             f"grammar_max_values ({config.grammar_max_values}): send fewer")
    if spec.kind != "json":
        return
    value = json.loads(spec.spec)
    levels = schema.depth(value)
    if levels > config.grammar_max_depth:
        raise RequestError("structured_outputs", f": the JSON schema nests {levels} levels deep, more than this "
                         f"server's grammar_max_depth ({config.grammar_max_depth}): flatten it")
    count = schema.num_values(value)
    if count > config.grammar_max_values:
        raise RequestError("structured_outputs", f": the JSON schema lists {count} enum/const values, more than this "
                         f"server's grammar_max_values ({config.grammar_max_values}): send fewer, or a "
                         "pattern or a plain string instead of the list")
