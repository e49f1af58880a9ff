"""Qwen3: `<think>...</think>` before the answer. The model writes the opening tag itself (Qwen3,
up to the 2507 releases) or the template puts it in the prompt (the thinking-only models); with
`chat_template_kwargs: {"enable_thinking": false}` the template writes an empty thought into the
prompt and the reply is all answer. A reply that never opens a thought is all answer."""

from __future__ import annotations

from server.reasoning.think_tags import ThinkTagParser, prompt_closes_thinking, prompt_opens_thinking


class Qwen3Parser(ThinkTagParser):
    def __init__(self, prompt_text: str | None, template_kwargs: dict):
        off = template_kwargs.get("enable_thinking") is False or prompt_closes_thinking(prompt_text)
        super().__init__(thinks=not off, inside=prompt_opens_thinking(prompt_text))
