"""A conversation rendered by the model's chat template, with vLLM's options: the one home of
their rules, for LLM.chat and the server's chat routes and /tokenize alike."""

from __future__ import annotations

import re
import secrets

# Arguments the caller gives the chat template itself: chat_template_kwargs may not set them.
TEMPLATE_OWN = ("conversation", "messages", "tools", "documents", "chat_template", "tokenize", "return_dict",
                "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs",
                "return_assistant_tokens_mask", "add_generation_prompt", "continue_final_message")


def conversation(messages, where: str = "messages") -> list[dict]:
    """`messages` as templates read them, checked (ValueError naming the message): each a dict with a
    string role and content a string, or OpenAI's list of text parts (joined by newlines, as the
    server joins them), or None in an assistant turn that makes tool calls."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where} must be a non-empty list of {{'role': ..., 'content': ...}} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"{where}[{i}] must be a dict with a string 'role' and a 'content', got {str(m)[:100]!r}")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError(f"{where}[{i}].content: only text parts, {{'type': 'text', 'text': ...}}, are "
                                 "supported")
            content = "\n".join(p["text"] for p in content)
        if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
            raise ValueError(f"{where}[{i}].content must be a string or a list of text parts (None only in an "
                             f"assistant turn with tool_calls), got {str(content)[:100]!r}")
        out.append({**m, "content": content})
    return out


def check_continue(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """continue_final_message leaves the last message open; a generation prompt would open a new one."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message: the last message cannot be continued when add_generation_prompt "
                         "opens a new one: set add_generation_prompt to false")


def check_template_kwargs(template_kwargs: dict | None) -> None:
    taken = sorted(set(template_kwargs or ()) & set(TEMPLATE_OWN))
    if taken:
        raise ValueError(f"chat_template_kwargs: {taken[0]!r} is set by the caller (use its own argument "
                         f"where there is one)")


def render(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
           continue_final_message: bool = False, template_kwargs: dict | None = None,
           tools: list | None = None) -> str:
    """The template's text for `messages` (ValueError naming the option when the options clash;
    the template's own exception when it rejects the conversation)."""
    check_continue(add_generation_prompt, continue_final_message)
    check_template_kwargs(template_kwargs)
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, **(template_kwargs or {}))


# ---- client text that spells a control token ------------------------------------------------------------

def special_texts(tokenizer) -> list[str]:
    """The text of each special (control) token, longest first: `<|im_start|>`, `<|eot_id|>`, ..."""
    texts = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            texts.add(str(token))
    return sorted((t for t in texts if t), key=lambda t: (-len(t), t))


class SpecialsAsText:
    """Encodes a conversation so that special-token text from the client (in message content, names,
    tool calls and results, tool definitions, template variables) is plain text, not control
    tokens: a user cannot close their turn and open a fake system one. The template's own markup
    keeps its control tokens. Such text is replaced by placeholders before rendering; the rendered
    text is split at the control tokens left (all the template's), and each piece between them,
    placeholders restored, is tokenized with special-token matching off. A tokenizer splits at its
    added tokens the same way, so a conversation without such text is tokenized as it always was."""

    def __init__(self, tokenizer):
        self.texts = special_texts(tokenizer)
        self._specials = re.compile("|".join(map(re.escape, self.texts))) if self.texts else None
        self._ids = {t: tokenizer.convert_tokens_to_ids(t) for t in self.texts}

    def mask(self, value, marker: str):
        """`value` (str, list, dict: keys too) with each special-token text replaced by
        f"{marker}{index}x", and whether any was."""
        found = False

        def walk(v):
            nonlocal found
            if isinstance(v, str):
                out = self._specials.sub(lambda m: f"{marker}{self.texts.index(m.group())}x", v)
                found = found or out != v
                return out
            if isinstance(v, list):
                return [walk(x) for x in v]
            if isinstance(v, dict):
                return {walk(k): walk(x) for k, x in v.items()}
            return v

        return (walk(value), found) if self._specials else (value, False)

    def encode(self, tokenizer, text: str, marker: str, add_special_tokens: bool) -> tuple[str, list[int]]:
        """(text with the placeholders restored, its token ids) of a rendered conversation."""
        restore = re.compile(re.escape(marker) + r"(\d+)x")

        def restored(piece: str) -> str:
            return restore.sub(lambda m: self.texts[int(m.group(1))], piece)

        ids = []
        for i, piece in enumerate(re.split(f"({self._specials.pattern})", text)):
            if i % 2:  # one of the template's control tokens
                ids.append(self._ids[piece])
            elif piece:
                ids += tokenizer(restored(piece), add_special_tokens=False, split_special_tokens=True).input_ids
        if add_special_tokens:  # the BOS (and EOS) the tokenizer adds around any text
            around, bare = (tokenizer("a", add_special_tokens=flag).input_ids for flag in (True, False))
            at = next((k for k in range(len(around) - len(bare) + 1) if around[k:k + len(bare)] == bare), None)
            if at is not None:  # (None: the tokenizer changes the text it wraps; then it wraps nothing here)
                ids = around[:at] + ids + around[at + len(bare):]
        return restored(text), ids


def encode(tokenizer, messages: list[dict], *, specials: SpecialsAsText | None, add_special_tokens: bool = False,
           tools: list | None = None, template_kwargs: dict | None = None, **options) -> tuple[str, list[int]]:
    """(text, token ids) of `messages` rendered by the template (`options`: render's). With
    `specials`, special-token text from the client is plain text (SpecialsAsText); without, it
    becomes control tokens (transformers' and vLLM's behaviour)."""
    marker, found = f"specialtext{secrets.token_hex(6)}n", False
    if specials is not None:
        (messages, tools, template_kwargs), found = specials.mask([messages, tools, template_kwargs], marker)
    text = render(tokenizer, messages, tools=tools, template_kwargs=template_kwargs, **options)
    if found:
        return specials.encode(tokenizer, text, marker, add_special_tokens)
    return text, tokenizer(text, add_special_tokens=add_special_tokens).input_ids
