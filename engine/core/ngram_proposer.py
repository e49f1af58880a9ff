"""Prompt lookup (vLLM's "ngram" method): draft tokens for a sequence from its own earlier text.

The longest n in [min_n, max_n] whose last n tokens occur earlier in the sequence (prompt and
output) picks the match; the up to k tokens that followed its most recent earlier occurrence are
the draft. Where the occurrence ends within k tokens of the sequence's end, the text from it on
repeats with that period, and the draft goes on repeating it (a loop the output fell into is
drafted k tokens deep, not one period). Copy-heavy work (a passage rewritten, code edited, an
answer quoting its context) repeats long runs, so the model often agrees with them; where
nothing repeats there is no draft and the step is a plain decode.
"""

from __future__ import annotations

import numpy as np


def propose(tokens: list[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k draft tokens continuing `tokens`, or [] when no n-gram of the allowed lengths
    recurs. O(len(tokens) * max_n) in vectorised numpy."""
    seq = np.asarray(tokens)
    length = len(seq)
    if length < min_n + 1 or k < 1:
        return []
    # ends[j]: an earlier occurrence could end at j (it must leave a token after it to propose).
    # Grow the match one token at a time, right to left: after m rounds ends[j] holds where
    # seq[j-m+1 .. j] == the last m tokens.
    ends = seq[:length - 1] == seq[-1]
    best = None
    for m in range(1, max_n + 1):
        if m > 1:
            # seq[j-m+1] == seq[length-m] for the candidates still alive; j >= m-1 for the index to exist.
            ends[:m - 1] = False
            shifted = np.empty_like(ends)
            shifted[m - 1:] = seq[:length - m] == seq[length - m]
            shifted[:m - 1] = False
            ends &= shifted
        alive = np.flatnonzero(ends)
        if len(alive) == 0:
            break
        if m >= min_n:
            best = int(alive[-1])  # the most recent occurrence of the longest match so far
    if best is None:
        return []
    draft = seq[best + 1:best + 1 + k].tolist()
    period = length - 1 - best
    while len(draft) < k:
        draft.append(draft[len(draft) - period])
    return draft
