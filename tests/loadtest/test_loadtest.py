"""The Locust load test: SSE validation and prompt mix (fast), then a live headless run (slow)."""

from __future__ import annotations

import csv
import json
import re
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class FakeStream:
    def __init__(self, lines):
        self.lines = lines

    def iter_lines(self):  # as requests' Response.iter_lines gives them: bytes
        for line in self.lines:
            yield line.encode()


def _data(obj) -> str:
    return "data: " + (obj if isinstance(obj, str) else json.dumps(obj))


def test_read_sse_accepts_a_well_formed_stream():
    from loadtest.workload import read_sse

    first = []
    lines = [_data({"choices": [{"delta": {"role": "assistant", "content": ""}}]}), "",
             _data({"choices": [{"delta": {"content": "Hi"}}]}), "", ": keep-alive",
             _data({"choices": [], "usage": {"completion_tokens": 1}}), "", _data("[DONE]"), ""]
    text, usage = read_sse(FakeStream(lines), lambda: first.append(1))
    assert text == "Hi" and usage == {"completion_tokens": 1} and first == [1]


def test_read_sse_keeps_line_separators_inside_a_data_line():
    """Tokens can decode to U+2028, U+2029 or U+0085, which JSON carries unescaped (the server's
    pydantic does; here ensure_ascii=False): each data line must stay whole. A real requests.Response
    over those bytes, so its own line splitting is what runs."""
    import io

    import requests

    from loadtest.workload import read_sse

    text = "a\u2028b\u2029c\x85d"
    events = [json.dumps({"choices": [{"delta": {"content": text}}]}, ensure_ascii=False),
              json.dumps({"choices": [], "usage": {"completion_tokens": 1}}), "[DONE]"]
    resp = requests.Response()
    resp.status_code = 200
    resp.raw = io.BytesIO("".join(f"data: {e}\n\n" for e in events).encode())
    assert read_sse(resp, lambda: None) == (text, {"completion_tokens": 1})


@pytest.mark.parametrize("lines,reason", [
    ([_data({"choices": [{"text": "a"}]})], "DONE"),
    ([_data("{oops"), _data("[DONE]")], "not JSON"),
    ([_data("[DONE]"), _data({"choices": []})], "after"),
    (["event: x", _data("[DONE]")], "not an SSE data line"),
    ([_data({"error": {"message": "boom"}}), _data("[DONE]")], "error"),
    ([_data("[DONE]")], "no choices"),
])
def test_read_sse_rejects_malformed_streams(lines, reason):
    from loadtest.workload import StreamError, read_sse

    with pytest.raises(StreamError, match=reason):
        read_sse(FakeStream(lines), lambda: None)


def test_prompt_mix_and_run_time_parsing():
    from loadtest.__main__ import parse_run_time
    from loadtest.workload import prompt_tokens

    rng = random.Random(0)
    n = [prompt_tokens(rng, 800) for _ in range(2000)]
    assert min(n) >= 1 and max(n) <= 800
    assert 0.45 < sum(x <= 40 for x in n) / len(n) < 0.65  # mostly short chat turns
    assert sum(x > 200 for x in n) > 0  # some long documents
    assert max(prompt_tokens(rng, 20) for _ in range(100)) <= 20
    assert [parse_run_time(t) for t in ("10", "10s", "2m", "1h30m")] == [10, 10, 120, 5400]


@pytest.fixture(scope="module")
def tokenizer():
    from tests.tiny_model import build_tokenizer

    return build_tokenizer()


def server_count(tok, kind: str, prompt: str) -> int:
    """Prompt tokens as the server counts them (server/prompts.py): the chat template for chat."""
    from loadtest.workload import messages

    if kind == "chat":
        text = tok.apply_chat_template(messages(prompt), tokenize=False, add_generation_prompt=True)
        return len(tok(text, add_special_tokens=False).input_ids)
    return len(tok(prompt).input_ids)


@pytest.mark.parametrize("max_model_len", [96, 160, 1024])
def test_sized_requests_fit_the_context_window(tokenizer, max_model_len):
    from loadtest.workload import KINDS, TokenCounter, request_pool

    pool = request_pool(1, TokenCounter(tokenizer), max_model_len, max_prompt_tokens=800, max_output_tokens=128,
                        size=200)
    for kind in KINDS:
        sizes = [(server_count(tokenizer, kind, p), m) for p, m in pool[kind]]
        assert all(n + m <= max_model_len and m >= 1 for n, m in sizes), (kind, max(n + m for n, m in sizes))
        assert max(n + m for n, m in sizes) > 0.8 * min(max_model_len, 800)  # the window is used, not avoided
        if max_model_len >= 1024:  # room to spare: the mix shows, with long prompts and the full output range
            assert max(n for n, _ in sizes) > 400 and max(m for _, m in sizes) > 100


def test_sizing_estimates_without_a_tokenizer_and_refuses_a_window_too_small(tokenizer):
    from loadtest.workload import TokenCounter, request_pool, sized_request

    estimate = TokenCounter(None)
    pool = request_pool(2, estimate, 256, max_prompt_tokens=800, max_output_tokens=128, size=100)
    for kind, reqs in pool.items():
        assert all(estimate(kind, p) + m <= 256 for p, m in reqs)
    assert request_pool(2, estimate, 256, 800, 128, size=100) == pool  # the seed fixes the mix
    assert request_pool(3, estimate, 256, 800, 128, size=100) != pool
    unlimited = request_pool(2, estimate, None, max_prompt_tokens=300, max_output_tokens=16, size=100)
    assert all(estimate(k, p) <= 300 + 60 and 1 <= m <= 16 for k, reqs in unlimited.items() for p, m in reqs)
    with pytest.raises(ValueError, match="max_model_len 8"):
        sized_request(random.Random(0), "chat", TokenCounter(tokenizer), 8, 800, 128)


def test_model_limits_read_from_v1_models():
    from loadtest.workload import model_limits

    assert model_limits({"data": [{"id": "m", "max_model_len": 1024}, {"id": "other"}]}) == ("m", 1024)
    assert model_limits({"data": [{"id": "m"}]}) == ("m", None)
    assert model_limits({}) == (None, None)


def test_missing_locust_exits_2_before_a_server_starts(monkeypatch, capsys):
    import importlib.util

    import engine.bench.launch
    from loadtest.__main__ import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "locust" else real(name, *a))
    monkeypatch.setattr(engine.bench.launch, "ServerProcess", None)  # any use fails loudly
    with pytest.raises(SystemExit) as exc:
        main(["--run-time", "5s"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1
    assert "pip install locust" in err and 'pip install "pagewise[bench]"' in err


def test_summary_ratio_ignores_ttft_and_aggregated_rows():
    from loadtest.__main__ import summarize

    def row(type_, name, reqs, fails):
        return {"Type": type_, "Name": name, "Request Count": str(reqs), "Failure Count": str(fails),
                "Median Response Time": "10", "95%": "20", "99%": "30", "Requests/s": "1.5"}

    rows = [row("POST", "chat (stream)", 10, 1), row("TTFT", "TTFT chat", 9, 0),
            row("POST", "completions", 10, 0), row("", "Aggregated", 29, 1)]
    table, total, fails = summarize(rows)
    assert (total, fails) == (20, 1) and "TTFT chat" in table


@pytest.mark.slow
def test_headless_locust_run_from_another_folder(tiny_model_dir, tmp_path):
    """Run outside the repository with a relative --out-dir; a small context window (128 tokens)
    that unsized prompts would overflow: not one request may fail."""
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest", "--model", tiny_model_dir, "--users", "4", "--spawn-rate", "4",
         "--run-time", "10s", "--max-output-tokens", "64", "--seed", "3",
         "--server-arg=--max-model-len=128", "--out-dir", "report", "--max-failure-ratio", "0"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    out = tmp_path / "report"
    for name in ("report.html", "locust_stats.csv", "locust_failures.csv", "locust_stats_history.csv",
                 "server.log", "requests.json"):
        assert (out / name).is_file(), name
    with open(out / "locust_stats.csv", newline="") as f:
        rows = {r["Name"]: r for r in csv.DictReader(f)}
    assert int(rows["Aggregated"]["Failure Count"]) == 0
    real = [r for n, r in rows.items() if n != "Aggregated" and r["Type"] != "TTFT"]
    assert sum(int(r["Request Count"]) for r in real) > 0
    assert any(r["Type"] == "TTFT" and int(r["Request Count"]) > 0 for r in rows.values())
    assert "0 failed" in proc.stdout and "max_model_len 128" in proc.stdout
    # The verdict counts what the server answered: its access log, every request of the run (the
    # CSV's last write missed those that finished in --stop-timeout's drain).
    served = len(re.findall(r'"POST /v1/(?:chat/)?completions HTTP/1.1" 200', (out / "server.log").read_text()))
    assert f"\n{served} requests, 0 failed" in proc.stdout, (served, proc.stdout[-1500:])
    pool = json.loads((out / "requests.json").read_text())
    assert pool["max_model_len"] == 128 and pool["exact_token_counts"]
    assert not (Path(ROOT) / "report").exists()
