"""Reasoning output for /v1/chat/completions, as vLLM's `--reasoning-parser` serves it: a thinking
model's reasoning goes to `message.reasoning_content` (streamed: `delta.reasoning_content`) and
only its answer to `content`; tool calls are read from the answer; a request's grammar (structured
output, a named or required tool call) applies from the end of the reasoning on.

One file a parser (each an incremental ReasoningParser, base.py); `Reasoning` is one request's use
of the server's parser."""

from __future__ import annotations

import dataclasses

from engine.sampling_params import SamplingParams
from server.reasoning.base import CONTENT, REASONING, ReasoningParser, count_reasoning_tokens
from server.reasoning.deepseek_r1 import DeepSeekR1Parser
from server.reasoning.gpt_oss import GptOssParser
from server.reasoning.qwen3 import Qwen3Parser

__all__ = ["CONTENT", "PARSERS", "REASONING", "Reasoning", "ReasoningParser", "count_reasoning_tokens"]

# vLLM's names; openai_gptoss is vLLM's registry name for gpt-oss's.
PARSERS = {"qwen3": Qwen3Parser, "deepseek_r1": DeepSeekR1Parser, "gpt_oss": GptOssParser,
           "openai_gptoss": GptOssParser}


@dataclasses.dataclass(frozen=True)
class Reasoning:
    """How one chat request's replies are read: the server's parser (None: no reasoning parser),
    with what the prompt and chat_template_kwargs say about thinking."""

    parser: str | None
    prompt_text: str | None = None
    template_kwargs: dict = dataclasses.field(default_factory=dict)

    def new_parser(self) -> ReasoningParser | None:
        """A fresh parser for one choice (None when the server has none)."""
        if self.parser is None:
            return None
        return PARSERS[self.parser](self.prompt_text, self.template_kwargs or {})

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """The request's parameters as this reasoning needs them: its grammar applies once the
        reasoning has ended (vLLM's rule), and a parser whose markers are special tokens gets them
        in the text."""
        probe = self.new_parser()
        if probe is None:
            return params
        changes = {}
        if probe.needs_special_tokens:
            changes["skip_special_tokens"] = False
        if params.structured_outputs is not None and probe.thinks:
            changes["structured_outputs"] = dataclasses.replace(params.structured_outputs,
                                                                reasoning_end=probe.reasoning_end)
        return dataclasses.replace(params, **changes) if changes else params
