"""Turn an OpenAI prompt or message list into token ids, and check it against the context window."""

from __future__ import annotations

from dataclasses import dataclass

from server.errors import bad_request


@dataclass
class Prompt:
    text: str | None  # None when the client sent token ids
    token_ids: list[int]


def completion_prompts(prompt, tokenizer) -> list[Prompt]:
    """`prompt` is a string, a list of strings, a token-id list or a list of those (already shape-checked)."""
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise bad_request("prompt must not be empty", param="prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            prompts.append(Prompt(item, tokenizer(item).input_ids))
        else:
            prompts.append(Prompt(None, list(item)))
        if not prompts[-1].token_ids:
            raise bad_request("prompt must not be empty", param="prompt")
    return prompts


def chat_prompt(messages: list[dict], tokenizer) -> Prompt:
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template: use /v1/completions", param="messages")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # a template may reject a conversation (e.g. roles that do not alternate)
        raise bad_request(f"the model's chat template rejected these messages: {e}", param="messages") from e
    # The template already wrote any BOS it wants; do not let the tokenizer add another.
    return Prompt(text, tokenizer(text, add_special_tokens=False).input_ids)


def resolve_max_tokens(num_prompt_tokens: int, requested: int | None, max_model_len: int,
                       field: str = "max_tokens", prompt_field: str = "prompt") -> int:
    """The number of tokens to generate: the request's, or what the context window has left."""
    if num_prompt_tokens >= max_model_len:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{num_prompt_tokens} tokens: shorten the prompt", param=prompt_field, code="context_length_exceeded")
    if requested is None:
        return max_model_len - num_prompt_tokens
    if isinstance(requested, int) and requested >= 1 and num_prompt_tokens + requested > max_model_len:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens, but {num_prompt_tokens + requested} "
            f"were requested ({num_prompt_tokens} in the prompt, {requested} in {field}): reduce {field} "
            f"to at most {max_model_len - num_prompt_tokens}", param=field, code="context_length_exceeded")
    return requested  # values below 1 are left to SamplingParams, which names the field
