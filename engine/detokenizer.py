"""Incremental detokenization and stop strings.

Text is decoded over a short sliding window of tokens: decoding ids[prefix:read] and ids[prefix:]
and emitting the difference keeps the tokenizer's own spacing rules (e.g. SentencePiece's
leading spaces) without re-decoding the whole output every step. A window that ends in U+FFFD
is an unfinished multi-byte character: nothing is emitted until the next token completes it.
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
        # While running, hold back as many characters as a stop string could still need, so that
        # text already streamed is never taken back by a stop string completed later.
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str | None:
        """Append one generated token; returns the stop string it completed, if any."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return self._check_stop(len(delta))

    def _check_stop(self, delta_len: int) -> str | None:
        """End at the stop string that occurs first in the text (one token's text can complete
        several); at equal starts, the longer one."""
        best = None
        for stop in self.stop:
            # Only a match that ends inside the new text is new.
            start = max(0, len(self.text) - delta_len - len(stop) + 1)
            idx = self.text.find(stop, start)
            if idx != -1 and (best is None or (idx, -len(stop)) < (best[0], -len(best[1]))):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self.text = self.text[: idx + len(stop)] if self.include_stop else self.text[:idx]
        return stop

    def output_text(self, finished: bool) -> str:
        if finished or not self.holdback:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]
