"""Locust users for an OpenAI-compatible server (pagewise or any other).

Each user mixes four requests: chat and completions, streamed and not, with prompt
lengths drawn from a short / medium / long mixture (chat questions, pasted paragraphs,
long documents) and a random max_tokens. Streamed requests are reported with their full
duration (until `data: [DONE]`), and their time to first token as a separate entry of
type TTFT ("TTFT chat", "TTFT completions"). A request fails on a non-2xx status, a body
that is not the expected JSON, or, when streamed, a data line that is not valid JSON or a
stream that does not end with `data: [DONE]`.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 4 -r 2 -t 30s

Custom options (command line or environment):
    --model-name / PAGEWISE_MODEL_NAME      model in requests (default: first of GET /v1/models)
    --api-key / PAGEWISE_API_KEY            bearer token (also OPENAI_API_KEY)
    --max-prompt-words / PAGEWISE_MAX_PROMPT_WORDS   cap on prompt length (default 400)
    --max-output-tokens / PAGEWISE_MAX_OUTPUT_TOKENS cap on max_tokens (default 128)
"""

from __future__ import annotations

import os
import random
import sys
import time

from locust import HttpUser, between, events, task

if __package__ in (None, ""):  # run as `locust -f loadtest/locustfile.py`: make the package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from loadtest.workload import StreamError, make_prompt, read_sse  # noqa: E402


@events.init_command_line_parser.add_listener
def _add_options(parser):
    parser.add_argument("--model-name", type=str, env_var="PAGEWISE_MODEL_NAME", default="",
                        help="model name sent in requests (default: first id of GET /v1/models)")
    parser.add_argument("--api-key", type=str, env_var="PAGEWISE_API_KEY", default="", is_secret=True,
                        help="bearer token (default: $OPENAI_API_KEY)")
    parser.add_argument("--max-prompt-words", type=int, env_var="PAGEWISE_MAX_PROMPT_WORDS", default=400,
                        help="longest prompt in words")
    parser.add_argument("--max-output-tokens", type=int, env_var="PAGEWISE_MAX_OUTPUT_TOKENS", default=128,
                        help="largest max_tokens asked for")


class OpenAIUser(HttpUser):
    wait_time = between(0.1, 1.0)
    _model_name: str | None = None  # shared by all users once resolved

    def on_start(self):
        opts = self.environment.parsed_options
        self.rng = random.Random()
        key = (getattr(opts, "api_key", "") or os.environ.get("OPENAI_API_KEY", "")) if opts else ""
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.max_words = getattr(opts, "max_prompt_words", 400) if opts else 400
        self.max_out = getattr(opts, "max_output_tokens", 128) if opts else 128
        name = getattr(opts, "model_name", "") if opts else ""
        if name:
            OpenAIUser._model_name = name
        if OpenAIUser._model_name is None:
            with self.client.get("/v1/models", headers=self.headers, name="GET /v1/models",
                                 catch_response=True) as r:
                try:
                    OpenAIUser._model_name = r.json()["data"][0]["id"]
                except Exception as e:
                    r.failure(f"cannot read the model name from /v1/models: {e}")

    def _body(self, kind: str, stream: bool) -> dict:
        prompt = make_prompt(self.rng, self.max_words)
        body = {"model": OpenAIUser._model_name or "default", "max_tokens": self.rng.randint(8, self.max_out),
                "temperature": self.rng.choice([0.0, 0.7, 1.0]), "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if kind == "chat":
            body["messages"] = [{"role": "system", "content": "You are a helpful assistant."},
                                {"role": "user", "content": prompt}]
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
            self.environment.events.request.fire(request_type="TTFT", name=f"TTFT {kind}", response_time=ttft[0] * 1000.0,
                                response_length=0, exception=None, context={})

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
