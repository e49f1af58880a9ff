"""Graceful shutdown: on SIGTERM the server stops admitting, gives running streams up to
--shutdown-timeout to finish, then ends them with a final `abort` chunk and [DONE], and exits."""

from __future__ import annotations

import json
import signal
import time

import httpx

from tests.server.server_harness import ServerProcess
from tests.tiny_model import build_tiny_llama


def test_sigterm_drains_then_aborts_running_streams(tmp_path):
    # a longer context than the shared tiny model, so a stream outlives the drain timeout
    model = build_tiny_llama(tmp_path / "long-ctx", max_position_embeddings=8192)
    proc = ServerProcess(["--model", model, "--num-kv-blocks", "1024", "--num-threads", "1",
                          "--shutdown-timeout", "1"], str(tmp_path / "server.log"))
    try:
        body = {"prompt": "A very long story:", "max_tokens": 8000, "temperature": 0, "ignore_eos": True,
                "stream": True}
        events = []
        with httpx.Client(base_url=proc.url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                for line in lines:
                    if line.startswith("data: "):
                        events.append(line[6:])
                    if len(events) == 3:
                        break
                t0 = time.monotonic()
                proc.proc.send_signal(signal.SIGTERM)
                for line in lines:
                    if line.startswith("data: "):
                        events.append(line[6:])
                ended = time.monotonic() - t0
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["choices"][0]["finish_reason"] == "abort"
        assert 0.8 <= ended < 15, f"stream ended {ended:.1f}s after SIGTERM (timeout 1s)"
        proc.proc.wait(timeout=30)
        log = proc.log()
        assert "draining" in log and "aborting 1 unfinished request" in log
        assert "Traceback" not in log
    finally:
        proc.stop()
