"""What every route needs, built once the engine has started: the engine, the served name,
metrics, token texts for logprobs, and the limits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import Request

from server.errors import APIError
from server.logprobs import TokenTexts
from server.metrics import ServerMetrics


@dataclass
class ServerState:
    engine: object  # AsyncEngine (or anything with its interface)
    served_model_name: str
    metrics: ServerMetrics
    token_texts: TokenTexts
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name:
            raise APIError(404, f"the model {name!r} does not exist: this server serves {self.served_model_name!r}",
                           param="model", code="model_not_found")


def get_state(request: Request) -> ServerState:
    return request.app.state.pagewise
