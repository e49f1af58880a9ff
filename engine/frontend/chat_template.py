"""A conversation rendered by the model's chat template, with vLLM's options: the one home of
their rules, for LLM.chat and the server's chat routes and /tokenize alike."""

from __future__ import annotations

# Arguments the caller gives the chat template itself: chat_template_kwargs may not set them.
TEMPLATE_OWN = ("conversation", "messages", "tools", "documents", "chat_template", "tokenize", "return_dict",
                "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs",
                "return_assistant_tokens_mask", "add_generation_prompt", "continue_final_message")


def check_continue(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """continue_final_message leaves the last message open; a generation prompt would open a new one."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message: the last message cannot be continued when add_generation_prompt "
                         "opens a new one: set add_generation_prompt to false")


def check_template_kwargs(template_kwargs: dict | None) -> None:
    taken = sorted(set(template_kwargs or ()) & set(TEMPLATE_OWN))
    if taken:
        raise ValueError(f"chat_template_kwargs: {taken[0]!r} is set by the caller (use its own argument "
                         f"where there is one)")


def render(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
           continue_final_message: bool = False, template_kwargs: dict | None = None,
           tools: list | None = None) -> str:
    """The template's text for `messages` (ValueError naming the option when the options clash;
    the template's own exception when it rejects the conversation)."""
    check_continue(add_generation_prompt, continue_final_message)
    check_template_kwargs(template_kwargs)
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, **(template_kwargs or {}))
