"""SamplingParams: what a request asks of generation, with OpenAI semantics, validated once."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

# Upper bounds taken from the OpenAI API where it sets one.
MAX_N = 128
# A seed is what a torch.Generator takes: a 64-bit integer (signed, as vLLM and OpenAI's API use it).
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1
# Temperatures below this sample the argmax anyway (logits / 1e-300 overflow to inf): vLLM treats
# them as greedy, and so do we.
GREEDY_TEMPERATURE = 1e-5
# Dividing a logit by a penalty near 0 overflows it; below this no penalty means anything more.
MIN_REPETITION_PENALTY = 0.01
# OpenAI's range for a logit bias: -100 bans a token in effect, +100 makes it the only choice.
MAX_LOGIT_BIAS = 100.0
# vLLM's bad_words: at most this many words a request, each at most this many characters.
MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 128, 256
# An embedding request's pooling of the final hidden states: the last prompt token's, or the mean.
POOLINGS = ("last", "mean")


GRAMMAR_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class RequestError(ValueError):
    """A request's parameter the engine refuses. `field` is the engine's name for it and the message
    is `field` + `rest`, so that a server can report it under the name its client sent instead;
    `code` is the machine-readable kind a server answers with, where one applies."""

    def __init__(self, field: str, rest: str, code: str | None = None):
        super().__init__(field + rest)
        self.field, self.rest, self.code = field, rest, code

    def named(self, name: str) -> str:
        """The message with its field called `name`."""
        return name + self.rest


class UnsatisfiableRequestError(RequestError):
    """A request's own parameters leave no token to sample at some step of its output (say,
    allowed_token_ids that its grammar never allows there): found as it runs, so it ends that
    request alone, reported to its client as a bad request (HTTP 400), not as an engine fault.
    Raised for a batch, `rows` holds each such row's own error (row index -> error)."""

    def __init__(self, field: str, rest: str, rows: dict | None = None):
        super().__init__(field, rest)
        self.rows = rows or {}


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint: `kind` is one of GRAMMAR_KINDS; `spec` its text (a JSON schema as JSON text,
    a regex, the choices as a JSON list, an EBNF grammar; "" for json_object). Hashable: the
    compiled grammar is cached by it."""

    kind: str
    spec: str = ""
    strict: bool = True  # json: no properties beyond the schema's (OpenAI's `strict`)
    # A reasoning model's text that ends its thinking: the grammar applies from after it, and the
    # thinking before it is free (vLLM's rule); "" applies it from the first token.
    reasoning_end: str = ""

    @classmethod
    def of(cls, kind: str, value, strict: bool = True, field: str = "structured_outputs") -> GrammarSpec:
        """From a request's value: a schema dict (or its JSON text), a regex, a list of choices, a
        grammar. A RequestError names `field`, the request's name for it."""
        if kind not in GRAMMAR_KINDS:
            raise RequestError(field, f" must use one of {', '.join(GRAMMAR_KINDS)}, got {kind!r}")
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise RequestError(field, f": the JSON schema is not valid JSON: {e}") from None
            if not isinstance(value, dict):
                raise RequestError(field, ": the JSON schema must be an object")
            return cls(kind, json.dumps(value), strict)  # property order kept: the output follows it
        if kind == "choice":
            if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
                raise RequestError(field, ": choice must be a non-empty list of non-empty strings")
            return cls(kind, json.dumps(value))
        if kind == "json_object":
            return cls(kind)
        if not isinstance(value, str) or not value:
            raise RequestError(field, f": {kind} must be a non-empty string")
        return cls(kind, value)


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (plus the chosen one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (OpenAI)
    # vLLM's: only these token ids may be sampled (every other logit -inf, greedy included); EOS
    # among them or not, as the caller lists it.
    allowed_token_ids: list[int] | None = None
    # vLLM's: words the output may not contain (engine/runner/bad_words.py: their token sequences, which
    # the engine fills in at admission from its tokenizer, since only it knows the vocabulary).
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)
    # Set: an embedding request. The prompt runs, nothing is generated, and the request ends with
    # the pooled, L2-normalised final hidden states (RequestOutput.embedding).
    pooling: str | None = None
    # Set: every sampled token must keep the output inside this grammar (engine/structured_output/).
    structured_outputs: GrammarSpec | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.logit_bias = dict(self.logit_bias or {})
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.bad_words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words or [])
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def penalised(self) -> bool:
        """Whether a presence, frequency or repetition penalty moves this request's logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def _validate(self) -> None:
        def check(ok: bool, name: str, rule: str) -> None:
            if not ok:
                got = repr(getattr(self, name))  # a value of thousands of items is not echoed whole
                raise RequestError(name, f" must be {rule}, got {got if len(got) <= 200 else got[:200] + '...'}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        check(is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"an integer in [1, {MAX_N}]")
        check(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
              "max_tokens", "a positive integer or None")
        check(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "a non-negative integer")
        if self.max_tokens is not None:
            check(self.min_tokens <= self.max_tokens, "min_tokens", f"<= max_tokens ({self.max_tokens})")
        check(is_num(self.temperature) and 0.0 <= self.temperature <= 2.0, "temperature", "in [0, 2]")
        check(is_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]")
        check(is_int(self.top_k) and self.top_k >= 0, "top_k", "-1, 0 (disabled) or a positive integer")
        check(is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]")
        check(is_num(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
              "presence_penalty", "in [-2, 2]")
        check(is_num(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
              "frequency_penalty", "in [-2, 2]")
        check(is_num(self.repetition_penalty) and MIN_REPETITION_PENALTY <= self.repetition_penalty <= 10.0,
              "repetition_penalty", f"in [{MIN_REPETITION_PENALTY}, 10]")
        check(self.seed is None or (is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX), "seed",
              f"None or an integer in [{SEED_MIN}, {SEED_MAX}] (64-bit)")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "a list of non-empty strings")
        check(len(self.stop) <= 16, "stop", "at most 16 strings")
        check(all(is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "a list of non-negative token ids")
        check(all(is_int(t) and t >= 0 for t in self.logit_bias), "logit_bias",
              "a map from non-negative token ids to biases")
        check(all(is_num(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for b in self.logit_bias.values()),
              "logit_bias", f"a map whose biases are in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        check(self.allowed_token_ids is None or (bool(self.allowed_token_ids) and all(
            is_int(t) and t >= 0 for t in self.allowed_token_ids)), "allowed_token_ids",
              "None or a non-empty list of non-negative token ids")
        check(len(self.bad_words) <= MAX_BAD_WORDS and all(
            isinstance(w, str) and w.strip() and len(w) <= MAX_BAD_WORD_CHARS for w in self.bad_words), "bad_words",
              f"a list of at most {MAX_BAD_WORDS} words (not blank, at most {MAX_BAD_WORD_CHARS} characters each)")
        check(self.pooling is None or self.pooling in POOLINGS, "pooling", f"None or one of {', '.join(POOLINGS)}")
        if self.pooling is not None:
            check(self.n == 1, "n", "1 for an embedding request (pooling set)")
        check(self.structured_outputs is None or isinstance(self.structured_outputs, GrammarSpec),
              "structured_outputs", "None or a GrammarSpec (GrammarSpec.of(kind, value))")
        for name in ("logprobs", "prompt_logprobs"):  # the upper bound is the engine's max_logprobs
            v = getattr(self, name)
            check(v is None or (is_int(v) and v >= 0), name, "None or a non-negative integer")


PARAM_NAMES = frozenset(f.name for f in fields(SamplingParams))  # the fields a RequestError can name
