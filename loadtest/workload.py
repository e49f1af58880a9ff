"""What the load-test users send and how a streamed answer is checked (no Locust import here,
so tests can use it without Locust's gevent monkey-patching)."""

from __future__ import annotations

import json
import random

WORDS = (
    "the a of to and in is that for it on with as was by be at this from or an are which "
    "model server request token cache block memory batch latency throughput prompt answer "
    "question system user assistant write explain summarize translate describe compare list "
    "history science city river mountain language music computer network energy market "
    "policy health garden kitchen travel weather ocean planet library museum school "
    "quickly carefully simple detailed short long important different common useful new old"
).split()

SHORT_TASKS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "Give me three names for a cat.",
    "Translate 'good morning' into Spanish.",
]


def prompt_words(rng: random.Random, cap: int) -> int:
    """Short chat turns are common, pasted documents rare: 55% / 35% / 10%."""
    roll = rng.random()
    if roll < 0.55:
        n = rng.randint(4, 30)
    elif roll < 0.90:
        n = rng.randint(30, 150)
    else:
        n = rng.randint(150, 600)
    return max(1, min(n, cap))


def make_prompt(rng: random.Random, cap: int) -> str:
    n = prompt_words(rng, cap)
    if n <= 12:
        return rng.choice(SHORT_TASKS)
    body = " ".join(rng.choice(WORDS) for _ in range(n - 8))
    return f"{rng.choice(SHORT_TASKS)} Context: {body}."


class StreamError(Exception):
    pass


def read_sse(resp, on_first_choice) -> tuple[str, dict | None]:
    """Consume an OpenAI SSE stream; returns (text, usage). Raises StreamError if malformed."""
    text, usage, done = [], None, False
    first = True
    for raw in resp.iter_lines(decode_unicode=True):
        if not raw or raw.startswith(":"):
            continue
        if not raw.startswith("data:"):
            raise StreamError(f"not an SSE data line: {raw[:80]!r}")
        data = raw[len("data:"):].strip()
        if done:
            raise StreamError("data after [DONE]")
        if data == "[DONE]":
            done = True
            continue
        try:
            msg = json.loads(data)
        except json.JSONDecodeError:
            raise StreamError(f"data line is not JSON: {data[:80]!r}") from None
        if not isinstance(msg, dict):
            raise StreamError("data line is not a JSON object")
        if "error" in msg:
            raise StreamError(f"error in stream: {str(msg['error'])[:200]}")
        choices = msg.get("choices") or []
        if choices:
            if first:
                on_first_choice()
                first = False
            c = choices[0]
            text.append((c.get("delta") or {}).get("content") or c.get("text") or "")
        if msg.get("usage"):
            usage = msg["usage"]
    if not done:
        raise StreamError("stream did not end with data: [DONE]")
    if first:
        raise StreamError("stream carried no choices")
    return "".join(text), usage
