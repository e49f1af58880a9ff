"""Locust users for an OpenAI-compatible server (pagewise or any other).

Each user mixes four requests: chat and completions, streamed and not, with prompt lengths
drawn from a short / medium / long mixture (chat questions, pasted paragraphs, long documents)
and a random max_tokens, sized so that prompt + max_tokens fits the served model's context
window (`max_model_len` from GET /v1/models). `python -m loadtest` sizes them exactly with the
served model's tokenizer and passes them in --requests-file; run alone, Locust estimates the
sizes (transformers cannot be imported under gevent). Streamed requests are reported with their
full duration (until `data: [DONE]`), and their time to first token as a separate entry of type
TTFT ("TTFT chat", "TTFT completions"). A request fails on a non-2xx status, a body that is not
the expected JSON, or, when streamed, a data line that is not valid JSON or a stream that does
not end with `data: [DONE]`.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 4 -r 2 -t 30s

Custom options (command line or environment):
    --model-name / PAGEWISE_MODEL_NAME      model in requests (default: first of GET /v1/models)
    --api-key / PAGEWISE_API_KEY            bearer token (else $OPENAI_API_KEY)
    --requests-file / PAGEWISE_REQUESTS_FILE         sized requests (written by python -m loadtest)
    --max-prompt-tokens / PAGEWISE_MAX_PROMPT_TOKENS   longest prompt in tokens (default 800)
    --max-output-tokens / PAGEWISE_MAX_OUTPUT_TOKENS   largest max_tokens (default 128)
    --seed / PAGEWISE_LOADTEST_SEED         seed of the prompt mix (default 0)
    --final-stats / PAGEWISE_FINAL_STATS    the run's statistics as JSON, written once every user has stopped
"""

from __future__ import annotations

import os
import random
import sys
import time

from gevent.lock import Semaphore
from locust import HttpUser, between, events, task

if __package__ in (None, ""):  # run as `locust -f loadtest/locustfile.py`: make the package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.bench.backends.openai_http import resolve_api_key  # noqa: E402
from loadtest.workload import (  # noqa: E402
    StreamError, TokenCounter, load_pool, messages, model_limits, read_sse, request_pool,
)


@events.init_command_line_parser.add_listener
def _add_options(parser):
    parser.add_argument("--model-name", type=str, env_var="PAGEWISE_MODEL_NAME", default="",
                        help="model name sent in requests (default: first id of GET /v1/models)")
    parser.add_argument("--api-key", type=str, env_var="PAGEWISE_API_KEY", default="", is_secret=True,
                        help="bearer token (default: $PAGEWISE_API_KEY, else $OPENAI_API_KEY)")
    parser.add_argument("--requests-file", type=str, env_var="PAGEWISE_REQUESTS_FILE", default="",
                        help="sized requests, as python -m loadtest writes them (default: drawn here, sizes estimated)")
    parser.add_argument("--max-prompt-tokens", type=int, env_var="PAGEWISE_MAX_PROMPT_TOKENS", default=800,
                        help="longest prompt in tokens (without --requests-file)")
    parser.add_argument("--max-output-tokens", type=int, env_var="PAGEWISE_MAX_OUTPUT_TOKENS", default=128,
                        help="largest max_tokens asked for (without --requests-file)")
    parser.add_argument("--seed", type=int, env_var="PAGEWISE_LOADTEST_SEED", default=0,
                        help="seed of the prompt mix: the pool of requests, and user i's picks (seed + i)")
    parser.add_argument("--final-stats", type=str, env_var="PAGEWISE_FINAL_STATS", default="",
                        help="write the run's final statistics here as JSON, once every user has stopped")


_environment = None  # Locust's, kept for the quit event (which is not handed it)


@events.init.add_listener
def _keep_environment(environment, **_):
    global _environment
    _environment = environment


@events.quit.add_listener
def _write_final_stats(**_):
    """--final-stats: one row per entry, as locust_stats.csv has them, taken after the drain of
    --stop-timeout. The CSV is rewritten every few seconds, so its last version misses the requests
    that finish during the drain, which report.html and the console count (a probe saw 155 requests
    there against 174)."""
    import json

    path = getattr(_environment.parsed_options, "final_stats", "") if _environment is not None else ""
    if not path or _environment.runner is None:
        return
    stats = _environment.runner.stats
    rows = [{"Type": e.method, "Name": e.name, "Request Count": e.num_requests, "Failure Count": e.num_failures,
             "Median Response Time": e.median_response_time, "95%": e.get_response_time_percentile(0.95),
             "99%": e.get_response_time_percentile(0.99), "Requests/s": e.total_rps}
            for e in [*sorted(stats.entries.values(), key=lambda e: (e.method, e.name)), stats.total]]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)


class OpenAIUser(HttpUser):
    wait_time = between(0.1, 1.0)
    # Shared by all users, set by the first one to start (the others wait for it).
    _model_name: str | None = None
    _pool: dict[str, list[tuple[str, int]]] | None = None
    _setup = Semaphore()
    _started = 0  # users started so far: user i picks requests with seed + i

    def option(self, name: str, default):
        opts = self.environment.parsed_options
        return getattr(opts, name, default) if opts else default

    def on_start(self):
        self.rng = random.Random(self.option("seed", 0) + OpenAIUser._started)
        OpenAIUser._started += 1
        key = resolve_api_key(self.option("api_key", None))
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        with OpenAIUser._setup:  # before any request: the sizes depend on the model
            if OpenAIUser._pool is None:
                self._prepare()

    def _prepare(self) -> None:
        option = self.option
        pool = load_pool(option("requests_file", "")) if option("requests_file", "") else None
        OpenAIUser._model_name = option("model_name", "") or (pool or {}).get("model")
        max_model_len = (pool or {}).get("max_model_len")
        if OpenAIUser._model_name is None or pool is None:
            with self.client.get("/v1/models", headers=self.headers, name="GET /v1/models",
                                 catch_response=True) as r:
                try:
                    first, max_model_len = model_limits(r.json())
                    OpenAIUser._model_name = OpenAIUser._model_name or first
                    if OpenAIUser._model_name is None:
                        raise ValueError("no model listed")
                except Exception as e:
                    r.failure(f"cannot read the model from /v1/models: {e}")
        OpenAIUser._pool = pool["requests"] if pool else request_pool(
            option("seed", 0), TokenCounter(None), max_model_len, option("max_prompt_tokens", 800),
            option("max_output_tokens", 128))

    def _body(self, kind: str, stream: bool) -> dict:
        prompt, max_tokens = self.rng.choice(OpenAIUser._pool[kind])
        body = {"model": OpenAIUser._model_name or "default", "max_tokens": max_tokens,
                "temperature": self.rng.choice([0.0, 0.7, 1.0]), "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if kind == "chat":
            body["messages"] = messages(prompt)
        else:
            body["prompt"] = prompt
        return body

    def _call(self, kind: str, stream: bool) -> None:
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        name = f"{kind}{' (stream)' if stream else ''}"
        t0 = time.perf_counter()
        ttft: list[float] = []
        with self.client.post(path, json=self._body(kind, stream), headers=self.headers, name=name,
                              stream=stream, catch_response=True) as r:
            if not 200 <= r.status_code < 300:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
                return
            try:
                if stream:
                    if not r.headers.get("content-type", "").startswith("text/event-stream"):
                        raise StreamError(f"content-type {r.headers.get('content-type')!r}, not text/event-stream")
                    read_sse(r, lambda: ttft.append(time.perf_counter() - t0))
                    # Report the whole stream, not only the time to the response headers.
                    r.request_meta["response_time"] = (time.perf_counter() - t0) * 1000.0
                else:
                    data = r.json()
                    choice = data["choices"][0]
                    text = choice["message"]["content"] if kind == "chat" else choice["text"]
                    if not isinstance(text, str) or "usage" not in data:
                        raise StreamError("response lacks text or usage")
            except Exception as e:  # malformed body, broken stream, dropped connection
                r.failure(f"{type(e).__name__}: {e}")
                return
            r.success()
        if ttft:
            self.environment.events.request.fire(request_type="TTFT", name=f"TTFT {kind}",
                                                 response_time=ttft[0] * 1000.0, response_length=0, exception=None,
                                                 context={})

    @task(3)
    def chat_stream(self):
        self._call("chat", stream=True)

    @task(2)
    def chat(self):
        self._call("chat", stream=False)

    @task(2)
    def completion_stream(self):
        self._call("completions", stream=True)

    @task(1)
    def completion(self):
        self._call("completions", stream=False)
