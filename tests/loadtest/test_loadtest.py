"""The Locust load test: SSE validation and prompt mix (fast), then a live headless run (slow)."""

from __future__ import annotations

import csv
import json
import os
import random
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class FakeStream:
    def __init__(self, lines):
        self.lines = lines

    def iter_lines(self, decode_unicode=True):
        yield from self.lines


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
    from loadtest.workload import make_prompt, prompt_words

    rng = random.Random(0)
    n = [prompt_words(rng, 400) for _ in range(2000)]
    assert min(n) >= 1 and max(n) <= 400
    assert 0.45 < sum(x <= 30 for x in n) / len(n) < 0.65  # mostly short chat turns
    assert sum(x > 150 for x in n) > 0  # some long documents
    assert all(len(make_prompt(rng, 20).split()) <= 30 for _ in range(100))
    assert [parse_run_time(t) for t in ("10", "10s", "2m", "1h30m")] == [10, 10, 120, 5400]


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
def test_headless_locust_run_against_a_live_server(tiny_model_dir, tmp_path):
    out = tmp_path / "report"
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest", "--model", tiny_model_dir, "--users", "4", "--spawn-rate", "4",
         "--run-time", "10s", "--max-prompt-words", "60", "--max-output-tokens", "16",
         "--server-arg=--max-model-len=512", "--out-dir", str(out), "--max-failure-ratio", "0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    for name in ("report.html", "locust_stats.csv", "locust_failures.csv", "locust_stats_history.csv",
                 "server.log"):
        assert (out / name).is_file(), name
    with open(out / "locust_stats.csv", newline="") as f:
        rows = {r["Name"]: r for r in csv.DictReader(f)}
    assert int(rows["Aggregated"]["Failure Count"]) == 0
    real = [r for n, r in rows.items() if n != "Aggregated" and r["Type"] != "TTFT"]
    assert sum(int(r["Request Count"]) for r in real) > 0
    assert any(r["Type"] == "TTFT" and int(r["Request Count"]) > 0 for r in rows.values())
    assert "0 failed" in proc.stdout
