"""DeepSeek-R1: its template ends the prompt inside the thought, so the reply's text before
`</think>` is reasoning whether or not the model writes `<think>` first (R1-0528 does); a reply
cut before `</think>` is all reasoning."""

from __future__ import annotations

from server.reasoning.think_tags import ThinkTagParser


class DeepSeekR1Parser(ThinkTagParser):
    def __init__(self, prompt_text: str | None, template_kwargs: dict):
        super().__init__(thinks=True, inside=True)
