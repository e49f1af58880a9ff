"""`<think>...</think>` reasoning, as Qwen3 and DeepSeek-R1 write it: the reasoning, then the
closing tag, then the answer. The opening tag is written by the model at the very start of its
reply, or by the chat template at the end of the prompt (then the reply starts inside it)."""

from __future__ import annotations

from server.reasoning.base import CONTENT, REASONING, ReasoningParser, partial_tag_at

THINK, END_THINK = "<think>", "</think>"


def prompt_opens_thinking(prompt_text: str | None) -> bool:
    """Whether the prompt ends inside an unclosed <think> (the template opened it for the model)."""
    text = prompt_text or ""
    return text.rfind(THINK) > text.rfind(END_THINK)


def prompt_closes_thinking(prompt_text: str | None) -> bool:
    """Whether the prompt's reply already holds a closed thought: the template's empty one when
    thinking is off (`<think>\\n\\n</think>\\n\\n` after the assistant's opening)."""
    text = (prompt_text or "").rstrip()
    return text.endswith(END_THINK)


class ThinkTagParser(ReasoningParser):
    """States: "opening" (the reply's start, which may be the opening tag, surrounding whitespace
    allowed), "reasoning" (up to the closing tag), "content" (the rest, as it is)."""

    reasoning_end = END_THINK

    def __init__(self, thinks: bool, inside: bool):
        """`thinks`: the reply may reason at all; `inside`: it starts inside the thought (text before
        the closing tag is reasoning even without an opening tag)."""
        super().__init__(thinks)
        self.inside = inside
        self.state = "opening" if thinks else "content"
        if not thinks:
            self.content_offset = 0

    def _step(self, final: bool) -> bool:
        if self.state == "opening":
            return self._opening(final)
        if self.state == "reasoning":
            at = self.buffer.find(END_THINK)
            if at >= 0:
                self._emit(REASONING, at)
                self._emit(None, len(END_THINK))
                self._answer_starts()
                self.state = "content"
                return True
            self._emit(REASONING, len(self.buffer) if final else partial_tag_at(self.buffer, (END_THINK,)))
            return False
        self._emit(CONTENT, len(self.buffer))
        return False

    def _opening(self, final: bool) -> bool:
        body = self.buffer.lstrip()
        if body.startswith(THINK):
            self._emit(None, len(self.buffer) - len(body) + len(THINK))  # the tag and the whitespace before it
            self.state = "reasoning"
            return True
        if not final and THINK.startswith(body):  # still all whitespace, or the tag's start
            return False
        self.state = "reasoning" if self.inside else "content"
        if self.state == "content":
            self._answer_starts()
        return True
