"""Structured output (SamplingParams.structured_outputs, xgrammar) on the default model: every
output parses and validates against its own schema (jsonschema as the oracle) for forty schemas,
greedy and sampled; regexes, choices and grammars are matched; constraints do not touch their
unconstrained neighbours; a bad spec is a ValueError naming the field before anything runs."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.sampling_params import GrammarSpec
from tests.engine.json_schemas import SCHEMAS


@pytest.fixture(scope="module")
def llm():
    with LLM(device="cpu", num_kv_blocks=512, max_model_len=1024, seed=0) as engine:
        yield engine


def _ask(schema) -> list[dict]:
    return [{"role": "user", "content": "Reply with a JSON object that fits this schema: " + json.dumps(schema)}]


@pytest.mark.slow  # ~35 s with its engine; the fast lane keeps the regex / choice / grammar tests
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forty_schemas_parse_and_validate(llm, temperature):
    params = [SamplingParams(max_tokens=200, temperature=temperature, seed=i,
                             structured_outputs=GrammarSpec.of("json", s)) for i, s in enumerate(SCHEMAS)]
    outs = llm.chat([_ask(s) for s in SCHEMAS], params, use_tqdm=False)
    for schema, out in zip(SCHEMAS, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    assert llm.engine.stats()["num_used_blocks"] == 0


def test_regex_choice_grammar_and_json_object(llm):
    specs = [GrammarSpec.of("regex", r"[0-9]{3}-[a-z]{2}"), GrammarSpec.of("choice", ["yes", "no", "maybe"]),
             GrammarSpec.of("grammar", 'root ::= "(" [a-c]+ ")"'), GrammarSpec.of("json_object", None)]
    ask = [{"role": "user", "content": 'Answer with the JSON object {"a": 1} and nothing else.'}]
    outs = llm.chat([ask] * len(specs), [SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=s)
                                         for s in specs], use_tqdm=False)
    regex, choice, grammar, obj = (o.outputs[0].text for o in outs)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", regex) and choice in ("yes", "no", "maybe")
    assert re.fullmatch(r"\([a-c]+\)", grammar)
    assert isinstance(json.loads(obj), dict)


def test_n2_and_an_unconstrained_neighbour(llm):
    """Both choices of a forked request follow the schema; a plain request in the same batch
    gives exactly what it gives alone."""
    schema = SCHEMAS[1]
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = llm.chat([_ask(schema)], plain, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.chat([_ask(schema), _ask(schema)],
                    [SamplingParams(n=2, max_tokens=100, temperature=1.0, seed=3,
                                    structured_outputs=GrammarSpec.of("json", schema)), plain], use_tqdm=False)
    for c in outs[0].outputs:
        jsonschema.validate(json.loads(c.text), schema)
    assert outs[1].outputs[0].token_ids == alone


MUTUAL = {"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                    "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
          "$ref": "#/$defs/a"}


@pytest.mark.parametrize("spec, message", [
    (("json", {"type": "object", "properties": {"a": {"type": "nonsense"}}}), "^structured_outputs: the json"),
    (("regex", "([a-"), "^structured_outputs: the regex"),
    (("grammar", "root ::= ("), "^structured_outputs: the grammar"),
    (("json", {"type": "string", "pattern": "^a+$", "maxLength": 3}), "^structured_outputs: .*not enforced"),
    # No output of them can ever end: the first refers only to itself, the next two require each other.
    (("json", {"$ref": "#"}), "^structured_outputs: the json admits no finite output"),
    (("json", MUTUAL), "^structured_outputs: the json admits no finite output"),
    (("json", {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "$defs": MUTUAL["$defs"]}),
     "^structured_outputs: the json has a part that can never end"),
    (("grammar", "root ::= root"), "^structured_outputs: the grammar admits no finite output"),
    (("grammar", 'root ::= "ab" rest\nrest ::= rest'), "^structured_outputs: the grammar admits no finite output"),
    (("json", {"$ref": "file:///etc/passwd"}), r"^structured_outputs: the JSON schema refers outside itself \(\$ref"),
    (("json", {"type": "object", "properties": {"a": {"$ref": "http://example.com/s.json"}}}),
     "^structured_outputs: the JSON schema refers outside itself"),
])
def test_bad_specs_are_refused_naming_the_field(llm, spec, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2, 3]], SamplingParams(structured_outputs=GrammarSpec.of(*spec)), use_tqdm=False)
    assert not llm.engine.parents


def test_properties_named_like_keywords_are_properties(llm):
    """A property named `pattern` beside one named `maxLength` is not the unenforced keyword pair."""
    schema = {"type": "object", "properties": {"pattern": {"type": "string", "maxLength": 5},
                                               "maxLength": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["pattern", "maxLength"], "additionalProperties": False}
    out = llm.chat([_ask(schema)], SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=GrammarSpec.of(
        "json", schema)), use_tqdm=False)[0].outputs[0]
    jsonschema.validate(json.loads(out.text), schema)


def test_grammars_of_one_empty_or_multibyte_output_are_admitted(llm):
    """The admission refuses only a grammar with no finite output: one whose only output is empty
    (the model must end at once) or starts with a multi-byte character passes, and the engine
    produces exactly that."""
    specs = [GrammarSpec.of("grammar", 'root ::= ""'), GrammarSpec.of("regex", "日本"), GrammarSpec.of("choice", ["é"])]
    outs = llm.generate(["Say something."] * 3, [SamplingParams(max_tokens=8, structured_outputs=s) for s in specs],
                        use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == ["", "日本", "é"]


def test_a_grammar_that_has_ended_ends_the_output(llm):
    """Once a grammar can only end, the output ends there, though min_tokens asks for more or
    ignore_eos says to go on (vLLM's rule): the end token was the only token the grammar allowed,
    and nothing may follow it. It was an internal error: min_tokens banned the end token too, the
    argmax of a row of -inf was token 0, which broke the grammar."""
    choice = GrammarSpec.of("choice", ["yes", "no"])
    ask = [{"role": "user", "content": "Yes or no?"}]
    free = llm.chat([ask], SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=choice),
                    use_tqdm=False)[0].outputs[0]
    params = [SamplingParams(max_tokens=20, min_tokens=10, temperature=0.0, structured_outputs=choice),
              SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0, structured_outputs=choice)]
    outs = llm.chat([ask] * 2, params, use_tqdm=False)
    assert free.text in ("yes", "no") and free.finish_reason == "stop"
    for out in outs:
        assert out.error is None
        c = out.outputs[0]
        assert (c.text, c.token_ids, c.finish_reason) == (free.text, free.token_ids, "stop")


def test_parameters_that_leave_no_token_fail_that_request_alone(llm):
    """allowed_token_ids the grammar never allows, a grammar that dead-ends after its first tokens, or
    only the end token allowed under min_tokens: the request ends with an error naming the fields
    (invalid_request: its client's to change, an HTTP 400), not token 0 sampled from a row of -inf;
    its neighbours get what they get alone, and no KV block stays taken."""
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(["Say something."] * 2, [plain, seeded], use_tqdm=False)]
    eos = llm.engine.eos_token_ids[0]
    dead_end = GrammarSpec.of("grammar", 'root ::= "ab" [^\\0-\\U0010ffff]')  # nothing can follow "ab"
    cases = [(SamplingParams(max_tokens=8, allowed_token_ids=[5, 6], structured_outputs=GrammarSpec.of(
                 "choice", ["yes", "no"])),
              "^allowed_token_ids: after 0 output tokens, allowed_token_ids and structured_outputs together"),
             (SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=dead_end),  # greedy; the others sample
              r"^structured_outputs: after \d+ output tokens the grammar allows no token"),
             (SamplingParams(max_tokens=8, min_tokens=2, allowed_token_ids=[eos]),
              "^allowed_token_ids: after 0 output tokens, allowed_token_ids and min_tokens together")]
    outs = llm.generate(["Say something."] * (len(cases) + 2), [p for p, _ in cases] + [plain, seeded],
                        use_tqdm=False)
    for out, (_, message) in zip(outs, cases):
        assert out.invalid_request and re.match(message, out.error), out.error
    assert outs[1].outputs[0].text == "ab"  # what the grammar allowed streamed out first
    # the neighbours, sampled again without the failed rows: a seeded one draws what it draws alone
    assert [o.error for o in outs[-2:]] == [None, None] and [o.outputs[0].token_ids for o in outs[-2:]] == alone
    assert llm.engine.stats()["num_used_blocks"] == 0


@pytest.mark.parametrize("kind, value, message", [("json", "{not json", "the JSON schema is not valid JSON"),
                                                  ("choice", [], "choice must be a non-empty list"),
                                                  ("xml", "x", "must use one of")])
def test_spec_shapes_are_checked(kind, value, message):
    with pytest.raises(ValueError, match=message):
        GrammarSpec.of(kind, value)


def test_a_compile_past_its_time_bound_is_refused_as_too_complex():
    """The store waits at most compile_timeout_s for a compile, then refuses the request as the
    client's error (a 400), and drops a compile not yet started."""
    import xgrammar

    from engine.sampling_params import UnsatisfiableRequestError
    from engine.structured_output import GrammarStore

    info = xgrammar.TokenizerInfo([bytes([b]) for b in range(256)] + [b"<end>"], stop_token_ids=[256])
    store = GrammarStore(info, cache_bytes=1 << 20, compile_timeout_s=0.001, json_value_limits=True)
    schema = {"enum": [f"value-{i}" for i in range(5_000)]}
    with pytest.raises(UnsatisfiableRequestError, match="^structured_outputs: the json did not compile within"):
        store.compiled(GrammarSpec.of("json", schema), max_tokens=16)


def test_the_compiled_grammars_are_bounded_in_memory():
    """Distinct schemas past the cache's bytes evict the least recently used ones."""
    import xgrammar

    from engine.structured_output import GrammarStore

    info = xgrammar.TokenizerInfo([bytes([b]) for b in range(256)] + [b"<end>"], stop_token_ids=[256])
    store = GrammarStore(info, cache_bytes=200_000, compile_timeout_s=10, json_value_limits=True)
    first = GrammarSpec.of("json", {"enum": [f"a{i}" for i in range(300)]})
    store.compiled(first, 16)
    for n in range(40):
        store.compiled(GrammarSpec.of("json", {"enum": [f"b{n}-{i}" for i in range(300)]}), 16)
    assert 1 <= store.num_cached < 41 and store.cached_bytes <= 200_000
    assert store.key(first, 16) not in store.cached_keys()


def test_a_grammar_with_a_lone_surrogate_is_refused_without_codec_text():
    """A JSON body may carry "\\ud800" alone; the grammar's text is then no valid UTF-8, and the
    client hears that, not Python's codec message."""
    from engine.sampling_params import GrammarSpec
    from engine.structured_output.grammar import to_grammar

    with pytest.raises(ValueError, match=r"^structured_outputs: the grammar holds text that is not valid UTF-8") as e:
        to_grammar(GrammarSpec("grammar", 'root ::= "\ud800"'))
    assert "codec" not in str(e.value)


def test_a_new_engine_compiles_a_grammar_before_its_first_step(tiny_models):
    """The sampling rank offers its grammars when it is built: a server in the same process waits for
    a first-seen grammar off the engine (wait_compiled), so not even the engine's first step compiles."""
    from engine import structured_output

    llm = LLM(tiny_models("llama"), device="cpu", num_kv_blocks=64, max_model_len=256, seed=0)
    spec = GrammarSpec("regex", "(yes|no)")
    structured_output.wait_compiled(spec, 8)  # before any step: the store compiles it now
    store = llm.engine.runner.grammar_offer.built.store
    assert store.key(spec, 8) in store.cached_keys() and store.num_cached == 1
    out = llm.generate(["Answer:"], SamplingParams(max_tokens=8, structured_outputs=spec), use_tqdm=False)[0]
    assert out.outputs[0].text in ("yes", "no") and store.num_cached == 1  # the step found it compiled
