"""What a request must satisfy before it is queued: the context window, the vocabulary and the
engine's limits. Every front end (the offline LLM, AsyncEngine, the data-parallel front) runs
`check_request` once per request and the core trusts what it is handed. The context-window rule
lives here alone: the server applies it to max_tokens and to prompts before they reach a front end.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine import structured_output
from engine.config import EngineConfig
from engine.loading.lora_adapter import AdapterError, check_adapter, target_shapes
from engine.request import LoRARequest
from engine.sampling_params import RequestError, SamplingParams

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # the code OpenAI's API answers these with


@dataclass(frozen=True)
class Limits:
    """What the model and the engine fixed at start."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_logprobs: int
    # LoRA: the projections an adapter may target, (in, out) each, and the largest rank; None: LoRA is off.
    lora_targets: dict[str, tuple[int, int]] | None = None
    max_lora_rank: int = 0

    @classmethod
    def of(cls, config: EngineConfig, hf_config, max_model_len: int) -> "Limits":
        return cls(hf_config.vocab_size, max_model_len, config.max_num_seqs, config.max_logprobs,
                   target_shapes(hf_config) if config.enable_lora else None, config.max_lora_rank)


def check_context(num_prompt_tokens: int, max_model_len: int, generates: bool = True) -> None:
    """The context window holds the prompt, and when the request generates, at least one token more."""
    if num_prompt_tokens + generates > max_model_len:
        room = " and at least one generated token" if generates else ""
        raise RequestError("prompt", f" has {num_prompt_tokens} tokens, but this model's maximum context length "
                                     f"(max_model_len) is {max_model_len} tokens, which must hold the prompt{room}: "
                                     "shorten it", code=CONTEXT_LENGTH_EXCEEDED)


def resolve_max_tokens(num_prompt_tokens: int, requested: int | None, max_model_len: int,
                       default: int | None = None) -> int:
    """The tokens a request may generate: the ones it asked for, which must fit beside the prompt
    (OpenAI's rule: a 400, not a silently shorter answer), or whatever the window has left, at most
    `default` (the model's max_new_tokens, as vLLM caps it)."""
    check_context(num_prompt_tokens, max_model_len)
    if requested is None:
        return min(max_model_len - num_prompt_tokens, default or max_model_len)
    if isinstance(requested, int) and requested >= 1 and num_prompt_tokens + requested > max_model_len:
        raise RequestError("max_tokens", f" is {requested}, but the prompt has {num_prompt_tokens} tokens and this "
                                         f"model's maximum context length is {max_model_len} tokens: lower it to "
                                         f"at most {max_model_len - num_prompt_tokens}", code=CONTEXT_LENGTH_EXCEEDED)
    return requested  # values below 1 are left to SamplingParams, which names the field


def check_lora(lora_request: LoRARequest | None, limits: Limits) -> None:
    """An adapter the engine can serve on this model (its folder checked once per version)."""
    if lora_request is None:
        return
    if not isinstance(lora_request, LoRARequest):
        raise RequestError("lora_request", f" must be a LoRARequest, got {type(lora_request).__name__}")
    if limits.lora_targets is None:
        raise RequestError("lora_request", ": LoRA serving is off; start the engine with enable_lora=True "
                                           "(--enable-lora) to serve adapters")
    try:
        check_adapter(lora_request.lora_path, limits.lora_targets, limits.max_lora_rank)
    except AdapterError as e:
        raise RequestError("lora_request", f": {e}") from None


def check_request(ids: list[int], params: SamplingParams, limits: Limits,
                  lora_request: LoRARequest | None = None) -> None:
    """Raises a RequestError naming the field when the request cannot be served as asked, beyond
    SamplingParams' own checks; a grammar's compile starts here (structured_output.admit)."""
    check_lora(lora_request, limits)
    if not ids:
        raise RequestError("prompt", " is empty: give at least one token")
    vocab_size = limits.vocab_size
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
        raise RequestError("prompt", f" token ids must be integers in [0, {vocab_size})")
    check_context(len(ids), limits.max_model_len, generates=params.pooling is None)  # an embedding generates nothing
    if params.n > limits.max_num_seqs:
        raise RequestError("n", f" must be at most max_num_seqs ({limits.max_num_seqs}), the sequences this server "
                                f"runs at once, got {params.n}")
    for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias),
                      ("allowed_token_ids", params.allowed_token_ids or [])):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise RequestError(name, f" must name token ids in [0, {vocab_size}), got {bad[0]}")
    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(params, name)
        if v is not None and v > limits.max_logprobs:
            raise RequestError(name, f" must be at most max_logprobs ({limits.max_logprobs}), got {v}")
    if params.structured_outputs is not None:
        structured_output.admit(params.structured_outputs, params.max_tokens)
