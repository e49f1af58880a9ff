"""`engine serve --data-parallel-size 2`, a real uvicorn server with two replica processes:
concurrent requests are spread over both (visible per replica in /metrics) and answer exactly
what one process answers; killing a replica mid-run fails the pending requests within seconds,
/health reports it, and stopping the server leaves no process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from tests.parallel.helpers import BLOCK_SIZE, MAX_TOKENS, NUM_BLOCKS, PROMPTS, engine_processes, pid_alive
from tests.server.server_harness import ServerProcess, get_metrics, metric

SERVER_ARGS = ["--data-parallel-size", "2", "--num-kv-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
               "--max-num-batched-tokens", "32", "--max-model-len", "128", "--num-threads", "1", "--seed", "0"]


@pytest.fixture(scope="module")
def server(gqa_model, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("dp-server") / "server.log")
    proc = ServerProcess(["--model", gqa_model, *SERVER_ARGS], log)
    yield proc
    proc.stop()


async def _complete(http: httpx.AsyncClient, prompt: str, max_tokens: int) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return await http.post("/v1/completions", json=body)


def test_concurrent_requests_spread_over_replicas_and_match_one_process(server, single_process_outputs):
    expected, _, _ = single_process_outputs

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            return await asyncio.gather(*(_complete(http, p, MAX_TOKENS) for p in PROMPTS))

    responses = asyncio.run(run())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    assert [r.json()["choices"][0]["text"] for r in responses] == [text for _, text in expected]
    text = get_metrics(server)
    routed = [metric(text, "pagewise:requests_routed_total", replica=str(i)) for i in (0, 1)]
    prompt_tokens = [metric(text, "pagewise:prompt_tokens_total", replica=str(i)) for i in (0, 1)]
    assert sum(routed) == len(PROMPTS) and min(routed) >= 3, routed  # least-loaded: about half each
    assert min(prompt_tokens) > 0, prompt_tokens
    assert metric(text, "pagewise:engine_healthy", replica="1") == 1.0


def test_a_replica_dying_while_idle_stops_the_server(gqa_model, tmp_path):
    """No request running when a replica dies: the server still exits, status 1, for its supervisor
    to restart it (it stayed up answering 503 and 500s until someone stopped it)."""
    proc = ServerProcess(["--model", gqa_model, *SERVER_ARGS], str(tmp_path / "server.log"))
    try:
        replicas = engine_processes(proc.proc.pid)
        assert len(replicas) == 2 and httpx.get(proc.url + "/health").status_code == 200
        os.kill(replicas[0], signal.SIGKILL)
        assert proc.proc.wait(30) == 1
        assert "data-parallel replica" in proc.log() and "supervisor restarts it" in proc.log()
    finally:
        proc.stop()


def test_killed_replica_fails_pending_requests_and_health(server):
    """Runs last in this module: it kills the server's engine."""
    everything = engine_processes(server.proc.pid)  # the two replica processes
    assert len(everything) == 2

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            pending = [asyncio.create_task(_complete(http, p, 100)) for p in PROMPTS[:8]]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # until both replicas are generating
                text = (await http.get("/metrics")).text
                if all((metric(text, "pagewise:generation_tokens_total", replica=str(i)) or 0) > 0 for i in (0, 1)):
                    break
                await asyncio.sleep(0.02)
            killed_at = time.monotonic()
            os.kill(everything[-1], signal.SIGKILL)
            responses = await asyncio.gather(*pending)
            failed_within = time.monotonic() - killed_at
            health = None
            while time.monotonic() - killed_at < 10:
                try:
                    health = await http.get("/health")
                except httpx.TransportError:
                    break  # the server is already on its way out (below)
                if health.status_code == 503:
                    break
                await asyncio.sleep(0.05)
            return responses, failed_within, health

    responses, failed_within, health = asyncio.run(run())
    assert failed_within < 10.0
    failed = [r for r in responses if r.status_code == 500]
    assert failed and all("engine stopped" in r.json()["error"]["message"] for r in failed)
    if health is not None:  # until it exits, /health says why
        assert health.status_code == 503 and "replica" in health.json()["error"]["message"]
    assert "data-parallel replica" in server.log() and "SIGKILL" in server.log()
    # A dead engine stops the server by itself, exit status 1, so that a supervisor restarts it.
    assert server.proc.wait(30) == 1
    server.stop()
    assert "supervisor restarts it" in server.log() and "Application shutdown complete" in server.log()
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in everything) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in everything if pid_alive(p)]
