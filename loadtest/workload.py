"""What the load-test users send and how a streamed answer is checked (no Locust import here,
so tests can use it without Locust's gevent monkey-patching).

Requests are sized in tokens against the served model's context window (`max_model_len`, as
GET /v1/models reports it): prompt + max_tokens always fits. Token counts are exact when the
served model's tokenizer is at hand (counted the way the server counts them: the chat template
for chat, the plain encoding for completions), else an upper estimate per word. The runner
(`python -m loadtest`) draws a seeded pool of sized requests with the tokenizer and hands it to
Locust as a file: transformers cannot be imported under Locust's gevent monkey-patching.
"""

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

SYSTEM_PROMPT = "You are a helpful assistant."
KINDS = ("chat", "completions")
POOL_SIZE = 512  # sized requests of each kind drawn up front; users pick from them


def prompt_tokens(rng: random.Random, cap: int) -> int:
    """A prompt length in tokens. Short chat turns are common, pasted documents rare: 55% / 35% / 10%."""
    roll = rng.random()
    if roll < 0.55:
        n = rng.randint(8, 40)
    elif roll < 0.90:
        n = rng.randint(40, 200)
    else:
        n = rng.randint(200, 800)
    return max(1, min(n, cap))


def messages(prompt: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}]


class TokenCounter:
    """The tokens a prompt takes on the server. With the served model's tokenizer: exact (chat:
    the chat template, then the text without added special tokens; completions: the text with
    them). Without one: WORD_TOKENS per word plus a template allowance, an upper estimate for
    the English words used here under ordinary tokenizers (not for tiny test vocabularies)."""

    WORD_TOKENS = 2
    CHAT_OVERHEAD = 48  # system prompt + role markers
    TEXT_OVERHEAD = 4  # BOS and the like

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        if tokenizer is not None and not getattr(tokenizer, "chat_template", None):
            self.tokenizer_for_chat = None
        else:
            self.tokenizer_for_chat = tokenizer

    def __call__(self, kind: str, prompt: str) -> int:
        tok = self.tokenizer_for_chat if kind == "chat" else self.tokenizer
        if tok is None:
            overhead = self.CHAT_OVERHEAD if kind == "chat" else self.TEXT_OVERHEAD
            return self.WORD_TOKENS * len(prompt.split()) + overhead
        if kind == "chat":
            text = tok.apply_chat_template(messages(prompt), tokenize=False, add_generation_prompt=True)
            return len(tok(text, add_special_tokens=False).input_ids)
        return len(tok(prompt).input_ids)


def sized_request(rng: random.Random, kind: str, count: TokenCounter, max_model_len: int | None,
                  max_prompt_tokens: int, max_output_tokens: int) -> tuple[str, int]:
    """A prompt and a max_tokens with count(prompt) + max_tokens <= max_model_len (None: no limit).

    max_tokens is drawn from [8, max_output_tokens], lowered to what the shortest prompt leaves;
    the prompt is a short task plus filler words, as long as the drawn length and the room left
    by max_tokens allow."""
    task = rng.choice(SHORT_TASKS)
    window = max_model_len if max_model_len else float("inf")
    room = window - count(kind, task)  # what the shortest prompt leaves for the output
    if room < 1:
        raise ValueError(f"max_model_len {max_model_len} leaves no room for even a short {kind} prompt "
                         f"({count(kind, task)} tokens)")
    top = int(min(max_output_tokens, room))
    max_tokens = rng.randint(min(8, top), top)
    budget = int(min(prompt_tokens(rng, max_prompt_tokens), window - max_tokens))
    return fill_prompt(rng, kind, task, budget, count), max_tokens


def fill_prompt(rng: random.Random, kind: str, task: str, budget: int, count: TokenCounter) -> str:
    """`task` plus as many filler words as fit in `budget` tokens (the task alone if none fit)."""
    words = [rng.choice(WORDS) for _ in range(max(0, budget))]  # a word is at least one token

    def text(n: int) -> str:
        return f"{task} Context: {' '.join(words[:n])}." if n else task

    lo, hi = 0, len(words)  # the longest fitting prefix of `words`, by bisection (counts grow with n)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(kind, text(mid)) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return text(lo)


def request_pool(seed: int, count: TokenCounter, max_model_len: int | None, max_prompt_tokens: int,
                 max_output_tokens: int, size: int = POOL_SIZE) -> dict[str, list[tuple[str, int]]]:
    """{kind: [(prompt, max_tokens), ...]}: `size` sized requests of each kind, the same for one seed."""
    rng = random.Random(seed)
    return {kind: [sized_request(rng, kind, count, max_model_len, max_prompt_tokens, max_output_tokens)
                   for _ in range(size)] for kind in KINDS}


def save_pool(path: str, pool: dict, model: str | None, max_model_len: int | None, exact: bool) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"model": model, "max_model_len": max_model_len, "exact_token_counts": exact,
                   "requests": pool}, f)


def load_pool(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    data["requests"] = {kind: [(p, int(m)) for p, m in reqs] for kind, reqs in data["requests"].items()}
    return data


def model_limits(models_response: dict) -> tuple[str | None, int | None]:
    """(first model id, its max_model_len) from a GET /v1/models body; None where absent."""
    data = (models_response or {}).get("data") or []
    if not data:
        return None, None
    card = data[0]
    max_len = card.get("max_model_len")
    return card.get("id"), int(max_len) if isinstance(max_len, int) and max_len > 0 else None


class StreamError(Exception):
    pass


def read_sse(resp, on_first_choice) -> tuple[str, dict | None]:
    """Consume an OpenAI SSE stream; returns (text, usage). Raises StreamError if malformed."""
    text, usage, done = [], None, False
    first = True
    # Lines split as bytes, on SSE's own ends (\r, \n) only, then decoded: requests' decode_unicode
    # splits with str.splitlines, which also breaks at U+2028, U+0085 and the like, characters a model's
    # tokens can hold and JSON carries unescaped (a random model's stream failed so in a CI run).
    for line in resp.iter_lines():
        raw = line.decode("utf-8")
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
