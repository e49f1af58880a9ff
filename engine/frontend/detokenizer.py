"""Incremental detokenization and stop strings, in constant work per token.

Text is decoded over a short sliding window of tokens: decoding ids[prefix:read] and ids[prefix:]
and emitting the difference keeps the tokenizer's own spacing rules (e.g. SentencePiece's
leading spaces) without re-decoding the whole output every step. A window that ends in U+FFFD
is an unfinished multi-byte character: nothing is emitted until the next token completes it (or
the output ends there: then its bytes come out as U+FFFD, as a whole decode gives them).

Text is released through `take()`. While a choice runs, the last (longest stop string - 1)
characters are held back: a stop string completed later may still claim them, and text already
released is never taken back. Only the held-back tail is kept, so a stop string is searched in
that tail plus the new text, never in the whole output.
"""

from __future__ import annotations

# Prompt tokens used as left context, so the first generated token is spaced as in the full text.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.pending = ""  # decoded, not yet released (at most holdback + the newest token's text)
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int, may_stop: bool = True) -> str | None:
        """Append one generated token; returns the stop string it completed, if any (the text then
        ends at it, and later tokens add nothing). `may_stop` False (below min_tokens): no stop
        string ends the text yet."""
        if self.stopped:
            return None
        self.ids.append(token_id)
        delta = self._window_text(final=False)
        if not delta:
            return None
        self.pending += delta
        return self._check_stop(len(delta)) if may_stop else None

    def _window_text(self, final: bool) -> str:
        """The window's new text, and the window slides past it; "" while it ends in an unfinished
        character, unless `final` (the output ends there: its bytes come out as U+FFFD, as a
        whole decode of the output gives them)."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        # Slide the window and drop what is left of it: the ids kept stay a handful.
        del self.ids[:self.read_offset]
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        return new_text[len(prefix_text):]

    def _check_stop(self, delta_len: int) -> str | None:
        """End at the stop string that occurs first in the text (one token's text can complete
        several); at equal starts, the longer one. Only a match ending in the new text is new,
        and such a match starts at most len(stop) - 1 characters before it: inside `pending`."""
        best = None
        for stop in self.stop:
            start = max(0, len(self.pending) - delta_len - len(stop) + 1)
            idx = self.pending.find(stop, start)
            if idx != -1 and (best is None or (idx, -len(stop)) < (best[0], -len(best[1]))):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self.pending = self.pending[: idx + len(stop)] if self.include_stop else self.pending[:idx]
        self.stopped = True
        return stop

    def take(self, finished: bool) -> str:
        """The text released since the last call: all of it once the choice has finished, else all
        but the held-back tail."""
        if finished and not self.stopped and (tail := self._window_text(final=True)):
            self.pending += tail  # an unfinished character the output ended in
            self._check_stop(len(tail))
        keep = 0 if finished or self.stopped else self.holdback
        cut = max(0, len(self.pending) - keep)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out
