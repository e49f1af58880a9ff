"""Turn an OpenAI prompt or message list into token ids, off the event loop, and check it against
the context window.

Tokenizing an 8 MB string takes seconds; on the event loop that would freeze every other client
and /health. So a prompt is measured in bytes first (a text longer than the context window
could hold, at the tokenizer's longest token, is refused without tokenizing), and the tokenizer
runs on its own thread with its own copy (fast tokenizers must not be shared across threads).
"""

from __future__ import annotations

import asyncio
import copy
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from jinja2 import TemplateError
from pydantic import BaseModel

from engine.core.admission import CONTEXT_LENGTH_EXCEEDED, check_context
from engine.frontend import chat_template
from engine.sampling_params import RequestError
from server.errors import bad_request

logger = logging.getLogger("pagewise.server")


@dataclass
class Prompt:
    text: str | None  # None when the client sent token ids
    token_ids: list[int]


def prompt_items(prompt) -> list:
    """The prompts in a (shape-checked) completions `prompt`: a string, a list of strings, a
    token-id list or a list of token-id lists. Counting them needs no tokenizer."""
    several = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    return list(prompt) if several else [prompt]


def longest_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes one token stands for. Vocabulary entries spell bytes with
    printable characters (byte-level BPE's 'Ġ', sentencepiece's '▁'), each at least one byte of
    its own, so an entry's own UTF-8 length bounds the text it matches."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=64)


class PromptTokenizer:
    """Tokenizes and applies the chat template on one worker thread, with its own tokenizer.

    parse_special_tokens_in_messages: special-token text in what the client sends to the chat
    template (message content, tool calls and results, tool definitions) becomes control tokens,
    as in transformers and vLLM; by default it is plain text (chat_template.SpecialsAsText)."""

    def __init__(self, tokenizer, max_model_len: int, parse_special_tokens_in_messages: bool = False):
        try:
            self._tokenizer = copy.deepcopy(tokenizer)
        except Exception:  # not copyable: this thread is then its only user besides decode
            self._tokenizer = tokenizer
        self._specials = None if parse_special_tokens_in_messages else chat_template.SpecialsAsText(self._tokenizer)
        self.max_model_len = max_model_len
        self.max_prompt_bytes = max_model_len * longest_token_bytes(tokenizer)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagewise-tokenize")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _check_bytes(self, num_bytes: int, param: str) -> None:
        if num_bytes > self.max_prompt_bytes:
            raise bad_request(
                f"this model's maximum context length is {self.max_model_len} tokens, and the {param} "
                f"({num_bytes} bytes) is certainly longer than that: shorten it", param=param,
                code=CONTEXT_LENGTH_EXCEEDED)

    async def completion_prompts(self, prompt, param: str = "prompt", generates: bool = True) -> list[Prompt]:
        """`prompt` is a string, a list of strings, a token-id list or a list of those (shape-checked);
        errors name `param` (the request's field: prompt, or an embeddings input, which generates nothing)."""
        items = prompt_items(prompt)
        for item in items:
            if not item:
                raise bad_request(f"{param} must not be empty", param=param)
            if isinstance(item, str):
                self._check_bytes(len(item.encode("utf-8", "surrogatepass")), param)
                continue
            try:
                check_context(len(item), self.max_model_len, generates)
            except RequestError as e:
                raise bad_request(e.named(param), param=param, code=e.code) from None
        texts = [item for item in items if isinstance(item, str)]
        encoded = iter(await self._run(self._encode_all, texts) if texts else [])
        return [Prompt(item, next(encoded)) if isinstance(item, str) else Prompt(None, list(item)) for item in items]

    def _encode_all(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self._tokenizer(t, add_special_tokens=add_special_tokens).input_ids for t in texts]

    async def text_prompt(self, text: str, add_special_tokens: bool = True) -> Prompt:
        """One text, tokenized as /v1/completions would (/tokenize); not checked against the
        context window beyond the byte bound that keeps the thread's work small."""
        self._check_bytes(len(text.encode("utf-8", "surrogatepass")), "prompt")
        return Prompt(text, (await self._run(self._encode_all, [text], add_special_tokens))[0])

    async def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                          add_special_tokens: bool = False, tools: list | None = None,
                          continue_final_message: bool = False, template_kwargs: dict | None = None) -> Prompt:
        """`tools`: the request's function definitions, for templates that render them;
        continue_final_message: the last message left open (protocol/chat.py's _ChatTemplateFields);
        template_kwargs: more variables for the template (chat_template_kwargs)."""
        if not getattr(self._tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template: use /v1/completions", param="messages")
        self._check_bytes(sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in messages), "messages")
        if tools:  # protocol.Tool models: as the client wrote them, for the template
            tools = [t.model_dump(exclude_unset=True) if isinstance(t, BaseModel) else t for t in tools]
        return await self._run(self._apply_template, messages, add_generation_prompt, add_special_tokens, tools,
                               continue_final_message, template_kwargs or {})

    def _apply_template(self, messages: list[dict], add_generation_prompt: bool, add_special_tokens: bool,
                        tools: list | None = None, continue_final_message: bool = False,
                        template_kwargs: dict | None = None) -> Prompt:
        try:
            text, ids = chat_template.encode(self._tokenizer, messages, specials=self._specials,
                                             add_special_tokens=add_special_tokens, tools=tools,
                                             template_kwargs=template_kwargs,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message)
        except TemplateError as e:  # the template's own raise_exception (e.g. roles that do not alternate)
            message = str(e) if type(e) is TemplateError else "it could not render them"
            raise bad_request(f"the model's chat template rejected these messages: {message[:300]}",
                              param="messages") from e
        except (TypeError, ValueError, LookupError, AttributeError) as e:  # a shape the template cannot read
            logger.info("the chat template failed on a request's messages: %s: %s", type(e).__name__, e)
            raise bad_request("the model's chat template could not render these messages", param="messages") from e
        # The template already wrote any BOS it wants: by default the tokenizer adds no other.
        return Prompt(text, ids)
