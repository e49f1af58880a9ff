"""gpt-oss: the harmony format's text form. A reply is messages, each a header then a body:
`<|channel|>analysis<|message|>...<|end|>` (the reasoning), then
`<|start|>assistant<|channel|>final<|message|>...` (the answer), which ends with `<|return|>`
(the end token, not in the text). The prompt ends with `<|start|>assistant`, so the first
header starts at `<|channel|>` (or at its recipient, ` to=...`). Analysis bodies are reasoning,
every other channel's body is answer; headers and the markers are markup, except that a message to
a function (`<|channel|>commentary to=functions.NAME ...<|message|>{arguments}`, ended by the
`<|call|>` end token) goes to the answer as `<|channel|>commentary to=functions.NAME<|message|>`
and its arguments, for the `openai` tool-call parser (server/tool_formats.py). Its markers are
special tokens, so the reply is detokenized with them."""

from __future__ import annotations

import re

from server.reasoning.base import CONTENT, REASONING, ReasoningParser, partial_tag_at

MESSAGE, CHANNEL = "<|message|>", "<|channel|>"
BODY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
FINAL = "<|channel|>final<|message|>"
_RECIPIENT = re.compile(r"\bto=(functions\.[^\s<]+)")


class GptOssParser(ReasoningParser):
    """States: "header" (markup up to <|message|>; the reply's first one decides whether it
    follows harmony at all), "body" (one message's text, up to its end marker), "plain" (a reply
    that does not start with a header: all answer)."""

    reasoning_end = FINAL
    needs_special_tokens = True

    def __init__(self, prompt_text: str | None, template_kwargs: dict):
        super().__init__(thinks=True)
        self.state = "header"
        self.channel = ""
        self.first = True  # the reply's first header, not read yet

    def _step(self, final: bool) -> bool:
        if self.state == "plain":
            self._emit(CONTENT, len(self.buffer))
            return False
        if self.state == "header":
            return self._header(final)
        kind = REASONING if self.channel == "analysis" else CONTENT
        ends = [(at, m) for m in BODY_ENDS if (at := self.buffer.find(m)) >= 0]
        if ends:
            at, marker = min(ends)
            self._emit(kind, at)
            self._emit(None, len(marker))
            self.state = "header"
            return True
        self._emit(kind, len(self.buffer) if final else partial_tag_at(self.buffer, BODY_ENDS))
        return False

    def _header(self, final: bool) -> bool:
        opening = self.buffer.lstrip()
        if self.first and not opening.startswith((CHANNEL, "to=")):
            if not final and (CHANNEL.startswith(opening) or "to=".startswith(opening)):
                return False  # whitespace, or the header's start
            self.state = "plain"  # not harmony: the model answered in plain text
            self._answer_starts()
            return True
        at = self.buffer.find(MESSAGE)
        if at < 0:
            if final:
                self._emit(None, len(self.buffer))  # a header cut short is markup all the same
            return False
        header = self.buffer[:at]
        channel = header.rsplit(CHANNEL, 1)[-1] if CHANNEL in header else ""
        self.channel = channel.split("<|", 1)[0].split(" ", 1)[0].strip()  # "commentary to=fn <|constrain|>json"
        recipient = _RECIPIENT.search(header)
        self._emit(None, at + len(MESSAGE))
        self.first = False
        if self.channel != "analysis" or recipient:
            self._answer_starts()
            self.channel = self.channel if self.channel != "analysis" else "commentary"
        if recipient:  # a call: its header, normalised, for the tool-call parser
            self._out.append((CONTENT, f"{CHANNEL}commentary to={recipient.group(1)}{MESSAGE}"))
        self.state = "body"
        return True
