"""One streamed request to an OpenAI-compatible server, timed like vLLM's benchmark client.

Timestamps are taken when an SSE `data:` line carrying a choice arrives: the first one
gives TTFT, each later one adds a gap to ITL, and the last one ends E2EL (the trailing
usage chunk and `[DONE]` carry no token and move no clock). Output tokens come from the
usage chunk (`stream_options.include_usage`); where a server sends none they are counted
by tokenizing the streamed text. A stream is a failure on a non-200 status, an
unparsable data line, no choice chunk at all, or a missing `data: [DONE]`.
"""

from __future__ import annotations

import json
import os
import time

from engine.bench.metrics import RequestResult


def build_payload(endpoint: str, model: str, prompt, output_len: int, ignore_eos: bool,
                  extra_body: dict | None = None) -> dict:
    if endpoint == "chat":
        text = prompt if isinstance(prompt, str) else None
        if text is None:
            raise ValueError("the chat endpoint takes text prompts (use --prompt-format text)")
        payload = {"model": model, "messages": [{"role": "user", "content": text}],
                   "max_completion_tokens": output_len}
    else:
        payload = {"model": model, "prompt": prompt, "max_tokens": output_len}
    payload.update({"temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}})
    if ignore_eos:
        payload["ignore_eos"] = True
    payload.update(extra_body or {})
    return payload


# Where a client finds its key when no --api-key is given, in order (`engine serve` reads the same).
API_KEY_ENV_VARS = ("PAGEWISE_API_KEY", "OPENAI_API_KEY")


def resolve_api_key(api_key: str | None = None) -> str | None:
    """--api-key, else $PAGEWISE_API_KEY, else $OPENAI_API_KEY, else None (no Authorization header)."""
    if api_key:
        return api_key
    return next((os.environ[name] for name in API_KEY_ENV_VARS if os.environ.get(name)), None)


def auth_headers(api_key: str | None) -> dict[str, str]:
    key = resolve_api_key(api_key)
    return {"Authorization": f"Bearer {key}"} if key else {}


def _delta_text(endpoint: str, choice: dict) -> str:
    if endpoint == "chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def sse_lines(resp):
    """The lines of an httpx streaming response, split at SSE's own line ends (\n, with \r\n's \r
    dropped) before decoding. httpx's aiter_lines also splits at U+2028, U+0085 and the like (as
    str.splitlines does), characters a model's tokens can hold and JSON carries unescaped, which broke
    a data line in two (loadtest's reader failed so on a random model in a CI run)."""
    pending = b""
    async for chunk in resp.aiter_bytes():
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode()
    if pending:
        yield pending.rstrip(b"\r").decode()


async def stream_request(client, url: str, payload: dict, headers: dict, endpoint: str,
                         prompt_len: int, tokenizer=None, t0: float = 0.0, on_token=None) -> RequestResult:
    """POST `payload` with stream=True to `url` (an httpx.AsyncClient) and time the chunks;
    `on_token()` is called at each choice-carrying chunk (the live progress line)."""
    out = RequestResult(prompt_len=prompt_len)
    chunks: list[str] = []
    st = time.perf_counter()
    out.start_time = st - t0
    last = st
    got_choice = done = False
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                out.error = f"HTTP {resp.status_code}: {body[:300]}"
                return out
            async for line in sse_lines(resp):
                line = line.strip()
                if not line or line.startswith(":"):  # blank separators, SSE comments / pings
                    continue
                if not line.startswith("data:"):
                    continue  # event:/id:/retry: fields carry no payload here
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    continue
                if done:
                    raise ValueError("data after [DONE]")
                msg = json.loads(data)
                if "error" in msg and not msg.get("choices"):
                    raise ValueError(f"error event in stream: {str(msg['error'])[:300]}")
                if choices := msg.get("choices"):
                    now = time.perf_counter()
                    if not got_choice:
                        got_choice = True
                        out.ttft = now - st
                    else:
                        out.itl.append(now - last)
                    last = now
                    chunks.append(_delta_text(endpoint, choices[0]))
                    if on_token is not None:
                        on_token()
                if usage := msg.get("usage"):
                    if usage.get("completion_tokens") is not None:
                        out.output_tokens = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        out.prompt_len = int(usage["prompt_tokens"])
    except Exception as e:  # network errors, malformed JSON: the request failed, the run goes on
        out.error = f"{type(e).__name__}: {e}"
        return out
    out.generated_text = "".join(chunks)
    out.latency = last - st
    if not got_choice:
        out.error = "no chunk with a choice: cannot time the first token"
    elif not done:
        out.error = "stream ended without data: [DONE]"
    else:
        out.success = True
        if not out.output_tokens:
            out.output_tokens = (
                len(tokenizer(out.generated_text, add_special_tokens=False).input_ids) if tokenizer else 1
            )
    return out
