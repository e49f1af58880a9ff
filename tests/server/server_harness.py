"""Start a real `python -m engine serve` subprocess and read its /metrics."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
API_KEY = "test-key-123"
MAX_BODY_BYTES = 65536
# Small, fixed KV pool: fast to allocate, and leaves no doubt about what "no blocks in use" means.
TINY_SERVER_ARGS = ["--num-kv-blocks", "2048", "--max-body-bytes", str(MAX_BODY_BYTES), "--num-threads", "1",
                    "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


def clean_env() -> dict:
    """This environment without the API-key variables the server reads, so that a developer's
    OPENAI_API_KEY does not lock the test servers."""
    return {k: v for k, v in os.environ.items() if k not in ("PAGEWISE_API_KEY", "OPENAI_API_KEY")}


class ServerProcess:
    def __init__(self, args: list[str], log_path: str, env: dict | None = None, startup_timeout: float = 180.0,
                 entry: str = "engine", device: str = "cpu", preexec_fn=None):
        """`entry`: the module run as `python -m ENTRY serve`; "engine.cli" is the `engine` console script.
        `device`: the server tests expect the CPU's float32 tokens and KV sizes, on a GPU machine too.
        `preexec_fn`: run in the child before the server starts (e.g. to set its resource limits)."""
        self.log_path = log_path
        self._log = open(log_path, "w")
        cmd = [sys.executable, "-m", entry, "serve", "--port", "0", "--device", device, *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**clean_env(), **(env or {})}, preexec_fn=preexec_fn)
        self.url = self._wait_listening(startup_timeout)
        self.base_url = self.url + "/v1"

    def _wait_listening(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"pagewise listening on (http://[\d.]+:\d+)", self.log())
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"server did not start in {timeout}s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def metric(text: str, name: str, **labels) -> float | None:
    """The value of one sample in Prometheus text format (labels matched as given)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        m = re.match(r"^([^\s{]+)(\{[^}]*\})?\s+(\S+)", line)
        if not m or m.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return None


def get_metrics(server) -> str:
    r = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    r.raise_for_status()
    return r.text


def burst(url: str, bodies: list[dict]) -> list[httpx.Response]:
    """POST every completions body at once; the responses, in order, each checked to be a 200, or a
    503 overload with Retry-After 1, nothing else."""
    import asyncio

    async def send():
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))

    responses = asyncio.run(send())
    for r in responses:
        assert r.status_code == 200 or (r.status_code == 503 and r.headers.get("retry-after") == "1"
                                        and r.json()["error"]["code"] == "overloaded"), (r.status_code, r.text)
    return responses
