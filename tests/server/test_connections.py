"""Connection hygiene against a live server: silent, dribbling, truncated and surplus connections
never lock out other clients, /health included; a WebSocket upgrade gets a JSON refusal; the
read timeouts never cut a response."""

from __future__ import annotations

import json
import os
import re
import resource
import select
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.server.server_harness import TINY_SERVER_ARGS, ServerProcess, clean_env

FILE_LIMIT = 1024
READ_TIMEOUT_S = 0.5  # every read timeout of the strict server
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


def _file_limit():
    resource.setrlimit(resource.RLIMIT_NOFILE, (FILE_LIMIT, FILE_LIMIT))


@pytest.fixture(scope="module")
def limited(tiny_model_dir, tmp_path_factory):
    """A server whose open-files limit (soft and hard) is 1,024, everything else default."""
    log = str(tmp_path_factory.mktemp("limited") / "server.log")
    proc = ServerProcess(["--model", tiny_model_dir, *TINY_SERVER_ARGS], log, preexec_fn=_file_limit)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def strict(tmp_path_factory):
    """Half-second read timeouts, on a model whose context lets a stream outlive them."""
    from tests.tiny_model import build_tiny_llama

    model = build_tiny_llama(tmp_path_factory.mktemp("long-ctx"), max_position_embeddings=8192)
    log = str(tmp_path_factory.mktemp("strict") / "server.log")
    t = str(READ_TIMEOUT_S)
    proc = ServerProcess(["--model", model, "--num-kv-blocks", "1024", "--num-threads", "1",
                          "--timeout-keep-alive", t, "--timeout-header", t, "--timeout-body", t], log)
    yield proc
    proc.stop()


@pytest.fixture
def many_files():
    """Room in this process for a few thousand sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"needs 4,096 open files here, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 8192, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _address(server) -> tuple[str, int]:
    host, port = server.url.rsplit("//", 1)[1].split(":")
    return host, int(port)


def _serves_within(server, seconds: float = 10.0) -> None:
    """/health and then a chat request answer, both within `seconds`."""
    t0 = time.monotonic()
    assert httpx.get(server.url + "/health", timeout=seconds).status_code == 200
    r = httpx.post(server.base_url + "/chat/completions", json=CHAT, timeout=seconds)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    assert time.monotonic() - t0 < seconds


def _unread(port: int) -> int:
    """Connections to `port` not yet accepted plus bytes sent to it not yet read, as the kernel counts
    them (/proc/net/tcp: a listening socket's rx_queue is its accept queue)."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return sum(int(row[4].split(":")[1], 16) for row in rows if int(row[1].split(":")[1], 16) == port)


def _open_fds(server) -> int:
    return len(os.listdir(f"/proc/{server.proc.pid}/fd"))


def _read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    sock.settimeout(timeout)
    t0, data = time.monotonic(), b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data, time.monotonic() - t0


def _json_error(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_2000_idle_connections_under_a_1024_file_limit(limited, many_files):
    _serves_within(limited)  # warm: the first request loads the CPU kernels
    host, port = _address(limited)
    log_before = os.path.getsize(limited.log_path)
    idle = []
    try:
        for _ in range(2000):  # connect and say nothing, as fast as the kernel takes them
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex((host, port))
            idle.append(s)
        _serves_within(limited, 2.0)
        assert _open_fds(limited) < FILE_LIMIT
    finally:
        for s in idle:
            s.close()
    time.sleep(0.5)
    log = limited.log()
    assert "Too many open files" not in log and "Traceback" not in log
    assert os.path.getsize(limited.log_path) - log_before < 100_000
    _serves_within(limited)


def test_past_the_limit_new_connections_get_503_and_health_still_answers(limited):
    limit = int(re.search(r"at most (\d+) connections open", limited.log()).group(1))
    assert limit <= FILE_LIMIT - 100  # room under the file limit for the server's own files
    host, port = _address(limited)
    busy = []
    try:
        for _ in range(limit):  # each has sent its headers and waits for the rest of its body: not idle
            s = socket.create_connection((host, port))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{")
            busy.append(s)
        # Until the server has read every one of them, a new connection may close one as idle: wait until
        # the kernel holds nothing unread for it (a moment, longer on a loaded CPU), then ask.
        deadline = time.monotonic() + 60
        while _unread(port) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _unread(port)
        r = httpx.get(limited.base_url + "/models", timeout=5)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "too_many_connections"
        assert "--limit-connections" in r.json()["error"]["message"]
        assert httpx.get(limited.url + "/health", timeout=5).status_code == 200
    finally:
        for s in busy:
            s.close()
    time.sleep(0.5)
    _serves_within(limited)


def test_a_dribbling_client_is_cut_while_others_are_served(strict):
    host, port = _address(strict)
    slow = {"headers": (socket.create_connection((host, port)), b"GET /health HTTP/1.1\r\nHost: t\r\n"),
            "body": (socket.create_connection((host, port)), b'{"prompt": "hi", "max_tokens": 1}')}
    slow["body"][0].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                            b"Content-Length: 33\r\n\r\n")
    t0, cut_after = time.monotonic(), {}
    try:
        for i in range(6):  # one byte a second from each, until the server answers
            for name, (sock, data) in slow.items():
                if name not in cut_after and select.select([sock], [], [], 0)[0]:
                    cut_after[name] = time.monotonic() - t0
                if name not in cut_after:
                    sock.sendall(data[i:i + 1])
            if len(cut_after) == len(slow):
                break
            assert httpx.get(strict.url + "/health", timeout=2).status_code == 200  # others meanwhile
            time.sleep(1.0)
        assert set(cut_after) == set(slow) and max(cut_after.values()) < READ_TIMEOUT_S + 2.5
        for name, (sock, _) in slow.items():
            status, error = _json_error(_read_until_closed(sock, 5)[0])
            assert (status, error["code"]) == (408, "request_timeout") and name in error["message"]
    finally:
        for sock, _ in slow.values():
            sock.close()
    _serves_within(strict)


def test_a_body_shorter_than_its_content_length_gets_408(strict):
    with socket.create_connection(_address(strict)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 200\r\n\r\n" + json.dumps({"prompt": "hi", "max_tokens": 1}).encode())
        answer, waited = _read_until_closed(s, 10)
    status, error = _json_error(answer)
    assert (status, error["code"], error["type"]) == (408, "request_timeout", "invalid_request_error")
    assert "body" in error["message"] and READ_TIMEOUT_S * 0.8 < waited < READ_TIMEOUT_S + 3
    _serves_within(strict)


def test_a_silent_connection_is_closed_after_the_keep_alive_timeout(strict):
    with socket.create_connection(_address(strict)) as s:
        answer, waited = _read_until_closed(s, 10)
    assert answer == b"" and READ_TIMEOUT_S * 0.8 < waited < READ_TIMEOUT_S + 3
    _serves_within(strict)


def test_a_websocket_upgrade_gets_a_json_refusal(strict):
    headers = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
               "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}
    r = httpx.get(strict.base_url + "/chat/completions", headers=headers, timeout=5)
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert error["code"] == "websocket_not_supported" and "stream" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    _serves_within(strict)


def test_read_timeouts_never_cut_a_stream(strict):
    body = {"prompt": "A long story:", "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
    t0, events = time.monotonic(), []
    with httpx.stream("POST", strict.base_url + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    lasted = time.monotonic() - t0
    assert lasted > 2 * READ_TIMEOUT_S, "the stream must outlive the read timeouts to prove anything"
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    _serves_within(strict)


def test_a_connection_limit_the_file_limit_cannot_hold_is_a_startup_error():
    done = subprocess.run([sys.executable, "-m", "engine", "serve", "--port", "0", "--limit-connections", "2000"],
                          capture_output=True, text=True, timeout=120, preexec_fn=_file_limit, env=clean_env())
    assert done.returncode == 2
    assert "--limit-connections 2000 does not fit the open-files limit of 1024" in done.stderr
    assert "Traceback" not in done.stderr
