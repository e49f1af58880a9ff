"""A conversation rendered by the model's chat template, with vLLM's options: the one home of
their rules, for LLM.chat and the server's chat routes and /tokenize alike."""

from __future__ import annotations

# Arguments the caller gives the chat template itself: chat_template_kwargs may not set them.
TEMPLATE_OWN = ("conversation", "messages", "tools", "documents", "chat_template", "tokenize", "return_dict",
                "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs",
                "return_assistant_tokens_mask", "add_generation_prompt", "continue_final_message")


def conversation(messages, where: str = "messages") -> list[dict]:
    """`messages` as templates read them, checked (ValueError naming the message): each a dict with a
    string role and content a string, or OpenAI's list of text parts (joined by newlines, as the
    server joins them), or None in an assistant turn that makes tool calls."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where} must be a non-empty list of {{'role': ..., 'content': ...}} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"{where}[{i}] must be a dict with a string 'role' and a 'content', got {str(m)[:100]!r}")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError(f"{where}[{i}].content: only text parts, {{'type': 'text', 'text': ...}}, are "
                                 "supported")
            content = "\n".join(p["text"] for p in content)
        if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
            raise ValueError(f"{where}[{i}].content must be a string or a list of text parts (None only in an "
                             f"assistant turn with tool_calls), got {str(content)[:100]!r}")
        out.append({**m, "content": content})
    return out


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
