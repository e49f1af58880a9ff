"""Engine logprobs ({token_id: logprob} per position) in OpenAI's completion and chat shapes."""

from __future__ import annotations

import functools
import re

from server.responses import ChatTokenLogprob, CompletionLogprobs, TopLogprob

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # sentencepiece byte fallback


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable-unicode table, reversed: how byte-level BPE spells raw bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenTexts:
    """Token id -> (text, raw bytes), cached. Bytes are exact for byte-level BPE and byte fallback,
    so a client can rebuild characters that span tokens."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = decoder is not None and "ByteLevel" in repr(decoder)

    @functools.lru_cache(maxsize=1 << 16)
    def get(self, token_id: int) -> tuple[str, list[int]]:
        raw = self._bytes(token_id)
        if raw is None:
            text = self.tokenizer.decode([token_id])
            return text, list(text.encode("utf-8"))
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _bytes(self, token_id: int) -> bytes | None:
        if token_id in self._special:
            return None
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return None
        if self._byte_level:
            table = _byte_decoder()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
            return None
        m = _BYTE_TOKEN.match(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        if "▁" in piece:  # sentencepiece's word boundary
            return piece.replace("▁", " ").encode("utf-8")
        return None

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]


def _chosen(position: dict[int, float] | None, token_id: int) -> float | None:
    if not position:
        return None
    return _logprob_or_floor(position.get(token_id))


def completion_logprobs(token_ids: list[int], positions: list[dict[int, float] | None], texts: TokenTexts,
                        text_offset: int = 0) -> CompletionLogprobs:
    """`text_offset` is where the first token starts in the choice's text."""
    out = CompletionLogprobs()
    for token_id, position in zip(token_ids, positions):
        token = texts.text(token_id)
        out.tokens.append(token)
        out.token_logprobs.append(_chosen(position, token_id))
        out.top_logprobs.append(None if position is None else _by_text(position, texts))
        out.text_offset.append(text_offset)
        text_offset += len(token)
    return out


def _by_text(position: dict[int, float], texts: TokenTexts) -> dict[str, float]:
    """OpenAI keys completion top_logprobs by token text; when two ids share a text (e.g. partial
    UTF-8 bytes, all shown as U+FFFD) the likelier one keeps the key."""
    top: dict[str, float] = {}
    for token_id, lp in sorted(position.items(), key=lambda kv: -kv[1]):
        top.setdefault(texts.text(token_id), _logprob_or_floor(lp))
    return top


def chat_logprobs(token_ids: list[int], positions: list[dict[int, float]], texts: TokenTexts,
                  top_n: int) -> list[ChatTokenLogprob]:
    content = []
    for token_id, position in zip(token_ids, positions):
        text, raw = texts.get(token_id)
        top = sorted(position.items(), key=lambda kv: -kv[1])[:top_n]
        content.append(ChatTokenLogprob(
            token=text, logprob=_logprob_or_floor(position.get(token_id)), bytes=raw,
            top_logprobs=[TopLogprob(token=texts.text(t), logprob=_logprob_or_floor(lp), bytes=texts.get(t)[1])
                          for t, lp in top]))
    return content


def _logprob_or_floor(lp: float | None) -> float:
    # JSON has no -inf; OpenAI reports impossible tokens as -9999.0
    if lp is None or lp != lp or lp == float("-inf"):
        return -9999.0
    return float(lp)
