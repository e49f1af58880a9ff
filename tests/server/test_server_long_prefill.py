"""Long prefills on CPU, default model: a huge prompt batch that its client abandons holds a new
request back by at most a step or two, and a running stream keeps getting tokens while long
prompts prefill, because a CPU step is held to a short prefill chunk (cpu_max_prefill_tokens /
cpu_max_prefill_attention) and an abort takes effect between chunks."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from tests.server.server_harness import ServerProcess, get_metrics, metric

HUGE_PROMPTS, HUGE_LEN = 16, 8000  # about 5 minutes of prefill on two cores
ABANDON_AFTER_S = 6.0
# Bounds with margin for a shared two-core machine, where one such step takes well under a second;
# with 2,048-token chunks a step deep into these prompts took 10-40 s.
MAX_FIRST_TOKEN_S = 2.5
MAX_TOKEN_GAP_S = 3.0


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    proc = ServerProcess([], str(tmp_path_factory.mktemp("long-prefill") / "server.log"))
    yield proc
    proc.stop()


async def _token_times(http: httpx.AsyncClient, body: dict) -> list[float]:
    """When each streamed chunk arrived."""
    times = []
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
    return times


@pytest.mark.slow
def test_abandoned_huge_prefill_holds_nobody_and_streams_go_on(default_server):
    rng = random.Random(0)
    huge = {"prompt": [[rng.randrange(1000, 40000) for _ in range(HUGE_LEN)] for _ in range(HUGE_PROMPTS)],
            "max_tokens": 1}
    running = {"prompt": "Once upon a time", "max_tokens": 256, "temperature": 0, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=default_server.url, timeout=300) as http:
            stream = asyncio.ensure_future(_token_times(http, running))
            await asyncio.sleep(1.0)  # it decodes
            sent = time.monotonic()
            with pytest.raises(httpx.TimeoutException):  # the client gives up: its prompts are aborted
                await http.post("/v1/completions", json=huge, timeout=ABANDON_AFTER_S)
            start = time.monotonic()
            first = (await _token_times(http, {"prompt": "Hello", "max_tokens": 1}))[0] - start
            return first, sent, start, await stream

    first, sent, abandoned, times = asyncio.run(main())
    assert first < MAX_FIRST_TOKEN_S, first
    # The running stream while the huge prompts prefilled: from its last token before them to its
    # first one after they were abandoned.
    during = [t for t in times if sent <= t <= abandoned]
    window = times[times.index(during[0]) - 1:times.index(during[-1]) + 2] if during else []
    gaps = [b - a for a, b in zip(window, window[1:])]
    assert len(during) >= 3 and max(gaps) < MAX_TOKEN_GAP_S, (len(during), gaps)

    text = get_metrics(default_server)
    assert metric(text, "pagewise:num_requests_running") == 0 and metric(text, "pagewise:num_used_kv_blocks") == 0
    with httpx.Client(base_url=default_server.url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
