"""On the default model, a schema that bounds none of its values still gives JSON that ends: the
closing bounds (engine/structured_output/closing.py) stop `"population_millions": 1111...` and a
string that repeats itself. Each output must finish ("stop", not "length") within 200 tokens,
parse, and validate against its schema (jsonschema as the oracle), greedy and sampled, through
response_format and through a named tool call, with the official client."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re

import httpx
import jsonschema
import openai
import pytest

from tests.engine.json_schemas import UNBOUNDED
from tests.server.server_harness import ServerProcess

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}},
                                                "required": ["city", "days"]}}}


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
with open(os.path.join(ROOT, "docs", "serving.md")) as f:
    DOC_EXAMPLES = [json.loads(block) for block in re.findall(r"```json\n(.+?)\n```", f.read(), re.S)]


def _ask(schema: dict) -> list[dict]:
    return [{"role": "user", "content": "Reply with a JSON object that fits this schema: " + json.dumps(schema)}]


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    """`engine serve` on the default model, started once for both tests, with an 8 MiB grammar cache
    (the memory test fills it; the closing test's few schemas fit it either way)."""
    log = str(tmp_path_factory.mktemp("default-server") / "server.log")
    proc = ServerProcess(["--grammar-cache-mib", "8"], log, startup_timeout=600, entry="engine.cli")
    yield proc
    proc.stop()


@pytest.mark.slow  # the default model, started for this file
def test_unbounded_schemas_and_a_named_tool_call_close(default_server):
    with openai.OpenAI(base_url=default_server.base_url, api_key="unused", max_retries=0, timeout=300) as client:
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

        def doc_reply(job):  # docs/serving.md's request bodies, as printed there
            body, temperature = job
            r = client.chat.completions.create(**body, temperature=temperature, seed=1)
            fmt = body.get("response_format")
            schema = fmt["json_schema"]["schema"] if fmt else body["tools"][0]["function"]["parameters"]
            return schema, r.choices[0], r.usage.completion_tokens

        with concurrent.futures.ThreadPoolExecutor(48) as pool:
            jobs = [pool.submit(schema_reply, (s, t)) for s in UNBOUNDED for t in (0.0, 0.7)]
            jobs += [pool.submit(tool_reply, t) for t in (0.0, 0.7)]
            jobs += [pool.submit(doc_reply, (body, t)) for body in DOC_EXAMPLES for t in (0.0, 0.7)]
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
    assert len(DOC_EXAMPLES) == 2  # the structured-output and the tool example
    assert sum(1 for _, c, _ in replies if c.message.tool_calls) == 4


def _schema(n: int) -> dict:
    """A 4 KB schema of its own (about 0.3 MB compiled for the default model's vocabulary)."""
    props = {f"field_{n}_{k}": ({"enum": [f"v{n}a{k}", f"v{n}b{k}", f"v{n}c{k}"]} if k % 2 else
                                {"type": "integer", "minimum": n, "maximum": n + k + 10}) for k in range(60)}
    return {"type": "object", "properties": props, "required": list(props)[:5]}


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.mark.slow  # the default model and 560 compiles, about 20 s
def test_distinct_schemas_leave_memory_bounded(default_server):
    """500 distinct schemas (150 MB of compiled grammars, were they all kept) after a warm-up that
    fills an 8 MiB grammar cache: the server's RSS stays within 50 MB of where it was."""
    proc = default_server

    async def send(schemas: range) -> None:
        async with httpx.AsyncClient(base_url=proc.url, timeout=120) as http:
            async def one(n: int) -> None:
                r = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1,
                                                             "structured_outputs": {"json": _schema(n)}})
                assert r.status_code == 200, r.text

            for start in range(schemas.start, schemas.stop, 8):
                await asyncio.gather(*(one(n) for n in range(start, min(start + 8, schemas.stop))))

    asyncio.run(send(range(60)))
    before = _rss_mb(proc.proc.pid)
    asyncio.run(send(range(60, 560)))
    after = _rss_mb(proc.proc.pid)
    assert after - before < 50, (before, after)
    assert httpx.get(proc.url + "/health").status_code == 200
