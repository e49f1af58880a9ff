"""What every route needs, built once the engine has started: the engine, the served name,
metrics, token texts for logprobs, and the limits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import Request

from engine.request import LoRARequest
from server.adapters import ServedAdapters
from server.errors import APIError, bad_request
from server.logprobs import TokenTexts
from server.metrics import ServerMetrics
from server.prompts import PromptTokenizer
from server.tool_calls import ToolConfig


@dataclass
class ServerState:
    engine: object  # AsyncEngine (or anything with its interface)
    served_model_name: str
    metrics: ServerMetrics
    token_texts: TokenTexts
    prompts: PromptTokenizer
    tools: ToolConfig = field(default_factory=ToolConfig)
    adapters: ServedAdapters = field(default_factory=ServedAdapters)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name and self.adapters.get(name) is None:
            served = ", ".join(repr(n) for n in [self.served_model_name, *self.adapters.by_name])
            raise APIError(404, f"the model {name!r} does not exist: this server serves {served}",
                           param="model", code="model_not_found")

    def lora_request(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's model field selects; None: the base model."""
        return self.adapters.get(name)

    def model_name(self, name: str | None) -> str:
        """The name a response reports: the adapter's when the request selected one."""
        return name if self.adapters.get(name) is not None else self.served_model_name

    def check_admissible(self, num_prompts: int, n: int) -> None:
        """A request whose sequences (prompts x n) exceed what the engine may ever hold, running
        plus waiting, is refused before anything is tokenized or queued."""
        limit = getattr(self.engine, "max_admissible_seqs", None)
        if limit is None or num_prompts * n <= limit:
            return
        config = self.engine.config
        raise bad_request(
            f"this request needs {num_prompts * n} sequences ({num_prompts} prompt(s) x n={n}), but this server "
            f"runs at most {config.max_num_seqs} (max_num_seqs) and queues at most {config.max_waiting_requests} "
            f"more (max_waiting_requests): send fewer prompts or a smaller n, or split the request",
            param="prompt" if num_prompts > 1 else "n", code="too_many_sequences")


def get_state(request: Request) -> ServerState:
    return request.app.state.pagewise
