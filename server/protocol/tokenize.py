"""vLLM's /tokenize and /detokenize requests."""

from __future__ import annotations


from pydantic import ConfigDict, Field, field_validator, model_validator

from server.protocol.fields import TokenId, _Request, _rules
from server.protocol.chat import CONTINUE_RULE, ChatMessage, _ChatTemplateFields


def _tokenize_forms() -> dict:
    """For the document: a prompt (and no chat-template field), or messages."""
    template = {name: False for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")}
    return {"oneOf": [{"required": ["prompt"], "properties": {"prompt": {"type": "string"},
                                                              "messages": {"type": "null"}, **template}},
                      {"required": ["messages"], "properties": {"prompt": {"type": "null"},
                                                                "messages": {"type": "array", "minItems": 1}}}]}


class TokenizeRequest(_ChatTemplateFields):
    """Either a completions `prompt` (a string) or chat `messages`, tokenized as the generation
    routes would: the chat template applied to messages (with the assistant's opening when
    add_generation_prompt, the template options as chat's), special tokens added to a plain prompt
    unless add_special_tokens is false."""

    model_config = ConfigDict(json_schema_extra=_rules(_tokenize_forms(), CONTINUE_RULE))
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, validate_default=True)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template adds them)
    return_token_strs: bool = False

    @field_validator("messages")
    @classmethod
    def _prompt_or_messages(cls, v, info):
        if v is not None and not v:
            raise ValueError("must not be empty")
        if "prompt" in info.data and (info.data["prompt"] is None) == (v is None):  # (a bad prompt says so itself)
            raise ValueError("give exactly one of prompt and messages")
        return v

    @model_validator(mode="after")
    def _template_options_need_messages(self):
        template = sorted(self.model_fields_set & set(_ChatTemplateFields.model_fields))
        if self.prompt is not None and template:
            raise ValueError(f"{template[0]} applies to messages (the chat template), not to a prompt: remove it")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]
