"""What every reasoning parser is: an incremental splitter of one choice's text into its reasoning
and its answer (content), fed the text piece by piece as it is generated, holding back only what
may still be the start of a tag. A whole response is the same parser fed the whole text at once,
so a streamed choice and a whole one split alike."""

from __future__ import annotations

REASONING, CONTENT = "reasoning", "content"


def partial_tag_at(text: str, tags: tuple[str, ...]) -> int:
    """Where the longest suffix of `text` that is a proper prefix of one of `tags` starts
    (len(text) if none): the text from there on may still become a tag."""
    for start in range(max(0, len(text) - max(map(len, tags)) + 1), len(text)):
        tail = text[start:]
        if any(tag.startswith(tail) for tag in tags):
            return start
    return len(text)


class ReasoningParser:
    """One choice's split. Subclasses implement `_step`, which reads `self.buffer` (text not yet
    given out), gives out what it can with `_emit`, and returns False when it needs more text."""

    # The text after which the answer starts: structured output's grammar applies from there on.
    reasoning_end: str = ""
    # Whether the parser reads special tokens' text (its markers are special tokens).
    needs_special_tokens: bool = False

    def __init__(self, thinks: bool):
        self.thinks = thinks  # whether the output starts (or may start) with reasoning
        self.buffer = ""
        self.consumed = 0  # characters of the choice's text read so far (given out or dropped as markup)
        self.content_offset: int | None = None  # where the answer starts in the choice's text, once known
        self._out: list[tuple[str, str]] = []

    def feed(self, text: str) -> list[tuple[str, str]]:
        """(REASONING or CONTENT, text) pieces, in order, that this new text makes certain."""
        self.buffer += text
        while self.buffer and self._step(final=False):
            pass
        return self._take()

    def finish(self) -> list[tuple[str, str]]:
        """The pieces left at the end of the choice: held-back text is what it looks like now."""
        while self.buffer and self._step(final=True):
            pass
        return self._take()

    def _take(self) -> list[tuple[str, str]]:
        out, self._out = self._out, []
        merged: list[tuple[str, str]] = []
        for kind, text in out:
            if merged and merged[-1][0] == kind:
                merged[-1] = (kind, merged[-1][1] + text)
            elif text:
                merged.append((kind, text))
        return merged

    def _emit(self, kind: str | None, n: int) -> None:
        """Give out the buffer's first n characters as `kind` (None: markup, dropped)."""
        if kind is not None and n:
            self._out.append((kind, self.buffer[:n]))
        self.buffer = self.buffer[n:]
        self.consumed += n

    def _answer_starts(self) -> None:
        if self.content_offset is None:
            self.content_offset = self.consumed

    def _step(self, final: bool) -> bool:
        raise NotImplementedError

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole choice's text; None for a part that is empty, except
        that a reply with no reasoning at all is its text as it is."""
        pieces = self.feed(text) + self.finish()
        reasoning = "".join(t for kind, t in pieces if kind == REASONING)
        content = "".join(t for kind, t in pieces if kind == CONTENT)
        if self.content_offset == 0:
            return None, content
        return reasoning or None, content or None


def count_reasoning_tokens(token_ids: list[int], content_offset: int | None, decode) -> int:
    """How many of a choice's tokens spelled its reasoning (its markup included): the fewest whose
    text reaches where the answer starts (all of them while the reasoning has not ended; none for
    a reply without reasoning). `decode`: token ids -> text, as the reply was detokenized."""
    if content_offset is None:
        return len(token_ids)
    lo, hi = 0, len(token_ids)
    while lo < hi:  # the first prefix whose text is at least content_offset characters long
        mid = (lo + hi) // 2
        if len(decode(token_ids[:mid])) >= content_offset:
            hi = mid
        else:
            lo = mid + 1
    return lo
