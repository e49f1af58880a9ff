"""The sampling rank's side of structured output: one matcher per constrained stream, and the batch's
bitmask of the tokens each stream's grammar allows next, applied to the logits before sampling."""

from __future__ import annotations

import numpy as np
import torch

from engine.sampling_params import GrammarSpec
from engine.structured_output.after_reasoning import AfterReasoning
from engine.structured_output.grammar import xgrammar
from engine.structured_output.store import GrammarStore


class StructuredOutputs:
    """The sampling rank's grammars: compiled once per spec (the store), one matcher per stream."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], apply_bitmask, config):
        """`apply_bitmask`: the kernel backend's apply_token_bitmask (xgrammar's own CPU one took
        6.4 ms for 32 x 49,152 logits; the C++ one skips the words a grammar allows whole).
        `config`: the EngineConfig (the cache size, compile time bound and closing bounds)."""
        xgr = xgrammar()
        self.xgr = xgr
        self.apply_bitmask = apply_bitmask
        self.vocab_size = vocab_size
        self.end_token_ids = list(eos_token_ids)  # the tokens a grammar ends on
        self.tokenizer = tokenizer  # to find the end of a stream's reasoning in its text
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids)
        self.store = GrammarStore(info, config.grammar_cache_mib << 20, config.grammar_compile_timeout_s,
                                  config.json_value_limits)

    def matcher(self, spec: GrammarSpec, max_tokens: int | None, accepted: list[int]):
        """A fresh matcher for a stream, advanced over the tokens it already has; for a spec with a
        reasoning_end, one that starts where the stream's reasoning ends."""
        m = self.xgr.GrammarMatcher(self.store.compiled(spec, max_tokens))
        if spec.reasoning_end:
            m = AfterReasoning(m, spec.reasoning_end,
                               lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False))
        for token in accepted:
            if not m.accept_token(token):
                raise ValueError("a stream's earlier tokens do not follow its grammar")
        return m

    def bitmask(self, num_rows: int, matchers: list, rows: list[int]) -> torch.Tensor:
        """int32 [num_rows, vocab / 32], bit t of row rows[i] set where `matchers[i]` allows token t
        next; other rows allow everything. Reads the matchers only: a retried batch masks the same way."""
        bitmask = self.xgr.allocate_token_bitmask(num_rows, self.vocab_size)  # all allowed
        for m, row in zip(matchers, rows):
            m.fill_next_token_bitmask(bitmask, row)
        return bitmask

    def only_ends(self, bitmask: torch.Tensor, row: int) -> bool:
        """Whether that row's grammar allows nothing but its end (an end token) next."""
        words = bitmask[row].numpy().view(np.uint32).copy()
        for t in self.end_token_ids:
            words[t >> 5] &= ~np.uint32(1 << (t & 31))
        return not words.any()

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Set to -inf, in place, every token the bitmask does not allow."""
        self.apply_bitmask(logits, bitmask.to(logits.device))
