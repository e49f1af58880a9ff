"""On the default model, a schema that bounds none of its values still gives JSON that ends: the
closing bounds (engine/structured_output/closing.py) stop `"population_millions": 1111...` and a
string that repeats itself. Each output must finish ("stop", not "length") within 200 tokens,
parse, and validate against its schema (jsonschema as the oracle), greedy and sampled, through
response_format and through a named tool call, with the official client."""

from __future__ import annotations

import concurrent.futures
import json

import jsonschema
import openai
import pytest

from tests.engine.json_schemas import UNBOUNDED
from tests.server.server_harness import ServerProcess

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}},
                                                "required": ["city", "days"]}}}


def _ask(schema: dict) -> list[dict]:
    return [{"role": "user", "content": "Reply with a JSON object that fits this schema: " + json.dumps(schema)}]


@pytest.mark.slow  # the default model, about 40 s with its start
def test_unbounded_schemas_and_a_named_tool_call_close(tmp_path):
    proc = ServerProcess([], str(tmp_path / "server.log"), startup_timeout=600, entry="engine.cli")
    try:
        with openai.OpenAI(base_url=proc.base_url, api_key="unused", max_retries=0, timeout=300) as client:
            def schema_reply(job):
                schema, temperature = job
                r = client.chat.completions.create(
                    model="SmolLM2-135M-Instruct", messages=_ask(schema), temperature=temperature, max_tokens=200,
                    seed=1, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
                return schema, r.choices[0], r.usage.completion_tokens

            def tool_reply(temperature):
                r = client.chat.completions.create(
                    model="SmolLM2-135M-Instruct", temperature=temperature, max_tokens=200, seed=1,
                    messages=[{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}],
                    tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
                return WEATHER["function"]["parameters"], r.choices[0], r.usage.completion_tokens

            with concurrent.futures.ThreadPoolExecutor(48) as pool:
                jobs = [pool.submit(schema_reply, (s, t)) for s in UNBOUNDED for t in (0.0, 0.7)]
                jobs += [pool.submit(tool_reply, t) for t in (0.0, 0.7)]
                replies = [j.result() for j in jobs]
        for schema, choice, tokens in replies:
            if choice.message.tool_calls:
                assert choice.finish_reason == "tool_calls", choice
                text = choice.message.tool_calls[0].function.arguments
            else:
                assert choice.finish_reason == "stop", (schema, choice.message.content)
                text = choice.message.content
            assert tokens < 200
            jsonschema.validate(json.loads(text), schema)
        assert sum(1 for _, c, _ in replies if c.message.tool_calls) == 2
    finally:
        proc.stop()
