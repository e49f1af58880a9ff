"""A grammar that starts where a reasoning model's thinking ends (vLLM's rule for structured output
with a reasoning parser): until the stream's text holds the end-of-reasoning text (`</think>`, or
gpt-oss's final-channel header), every token is allowed and the grammar is not advanced; from the
token that completes it on, the grammar's matcher decides. The text is found by decoding the
stream's last few tokens, so it is found however the tokenizer spells it (one added token, or
several pieces)."""

from __future__ import annotations


class AfterReasoning:
    """An xgrammar GrammarMatcher's interface (accept_token, fill_next_token_bitmask,
    is_terminated) in front of one, for a stream that reasons first."""

    def __init__(self, matcher, reasoning_end: str, decode):
        """`decode`: token ids -> their text, special tokens included."""
        self.matcher = matcher
        self.end = reasoning_end
        self.decode = decode
        self.window: list[int] | None = []  # the stream's last tokens while it reasons; None once it has ended

    @property
    def reasoning(self) -> bool:
        return self.window is not None

    def accept_token(self, token_id: int) -> bool:
        if self.window is None:
            return self.matcher.accept_token(token_id)
        self.window.append(token_id)
        # Each token adds at least one character, so this many tokens spell the end text whole.
        del self.window[:-len(self.end)]
        text = self.decode(self.window)
        at = text.find(self.end)
        if at < 0:
            return True
        self.window = None
        rest = text[at + len(self.end):]
        # The answer's first characters, where the token that ended the thought carries them too.
        return not rest.strip() or self.matcher.accept_string(rest)

    def fill_next_token_bitmask(self, bitmask, row: int) -> None:
        if self.window is None:
            self.matcher.fill_next_token_bitmask(bitmask, row)
        # while reasoning the row stays as allocated: every token allowed

    def is_terminated(self) -> bool:
        return self.window is None and self.matcher.is_terminated()
