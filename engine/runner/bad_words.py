"""vLLM's bad_words: words a request's output may not contain, as token sequences.

A word is banned as the tokens it encodes to on its own and, where different, with one leading
space (how it is spelled after another word in byte-level BPE and sentencepiece vocabularies). At
each step the last token of a sequence gets no probability when the output so far ends with the
rest of it (a one-token word: always). Matching reads the output alone, not the prompt; a word that
the model spells with other tokens is not caught (vLLM's rule, and its limits).
"""

from __future__ import annotations


def token_sequences(words: list[str], tokenizer) -> list[list[int]]:
    """The token-id sequences to ban for `words`: each word's own encoding, and its encoding after
    a space where that differs; no duplicates."""
    found: list[list[int]] = []
    for word in words:
        word = word.lstrip()
        for text in (word, " " + word):
            ids = list(tokenizer(text, add_special_tokens=False).input_ids)
            if ids and ids not in found:
                found.append(ids)
    return found


def banned_next(sequences: list[list[int]], output: list[int]) -> list[int]:
    """The tokens that would complete one of `sequences` if sampled after `output`."""
    return [seq[-1] for seq in sequences
            if len(seq) == 1 or (len(output) >= len(seq) - 1 and output[len(output) - len(seq) + 1:] == seq[:-1])]
