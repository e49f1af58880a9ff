"""Graceful shutdown: on SIGTERM the server stops admitting, gives running streams up to
--shutdown-timeout to finish, then ends them with a final `abort` chunk and [DONE], and exits 0;
a second signal exits at once."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.server.server_harness import ServerProcess
from tests.tiny_model import build_tiny_llama


@pytest.fixture(scope="module")
def long_ctx_model(tmp_path_factory):
    """A longer context than the shared tiny model, so a stream outlives the drain timeout."""
    return build_tiny_llama(tmp_path_factory.mktemp("long-ctx"), max_position_embeddings=8192)


def _stream_events(url: str, max_tokens: int, events: list, started: threading.Event) -> None:
    body = {"prompt": "A very long story:", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
    except httpx.HTTPError as e:
        events.append(e)
    started.set()


def _start_stream(url: str, max_tokens: int) -> tuple[threading.Thread, list]:
    events, started = [], threading.Event()
    thread = threading.Thread(target=_stream_events, args=(url, max_tokens, events, started))
    thread.start()
    assert started.wait(60)
    return thread, events


def test_sigterm_drains_then_aborts_running_streams_and_exits_0(long_ctx_model, tmp_path):
    proc = ServerProcess(["--model", long_ctx_model, "--num-kv-blocks", "1024", "--num-threads", "1",
                          "--shutdown-timeout", "1"], str(tmp_path / "server.log"))
    try:
        long_stream, long_events = _start_stream(proc.url, 8000)
        short_stream, short_events = _start_stream(proc.url, 24)
        t0 = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        short_stream.join(30)
        long_stream.join(30)
        ended = time.monotonic() - t0
        # the short one finished within the drain; the long one got a final abort event
        assert short_events[-1] == "[DONE]" and json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"
        assert long_events[-1] == "[DONE]" and json.loads(long_events[-2])["choices"][0]["finish_reason"] == "abort"
        assert 0.8 <= ended < 15, f"stream ended {ended:.1f}s after SIGTERM (timeout 1s)"
        assert proc.proc.wait(timeout=30) == 0
        log = proc.log()
        assert "draining" in log and "aborting 1 unfinished request" in log
        assert "Traceback" not in log
    finally:
        proc.stop()


def test_a_second_signal_exits_at_once(long_ctx_model, tmp_path):
    proc = ServerProcess(["--model", long_ctx_model, "--num-kv-blocks", "1024", "--num-threads", "1",
                          "--shutdown-timeout", "60"], str(tmp_path / "server.log"))
    try:
        stream, events = _start_stream(proc.url, 8000)
        proc.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.proc.poll() is None, "the first signal drains: the stream may run for a minute"
        t0 = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(timeout=10) == 128 + signal.SIGTERM
        assert time.monotonic() - t0 < 3
        stream.join(30)
        assert events[-1] != "[DONE]"  # cut, not finished
        assert "signal 15 again: exiting now, cutting 1 running request" in proc.log()
    finally:
        proc.stop()
