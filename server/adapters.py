"""The LoRA adapters a server serves by name (vLLM's interface): those given at start with
--lora-modules, and, with --enable-runtime-lora, those loaded and unloaded through
/v1/load_lora_adapter and /v1/unload_lora_adapter. A request selects one with its `model` field.
Each loaded adapter gets a fresh integer id, so an adapter unloaded and loaded again from another
folder never meets the old one's slots or cached KV."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

from engine.request import LoRARequest


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """One --lora-modules item: name=path, or vLLM's JSON form {"name": ..., "path": ...,
    "base_model_name": ...}; ValueError saying which form it missed."""
    text = text.strip()
    if text.startswith("{"):
        try:
            item = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {text!r} is not valid JSON ({e})") from None
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not isinstance(item.get("path"), str):
            raise ValueError(f"--lora-modules {text!r}: the JSON form needs string fields name and path "
                             "(base_model_name optional)")
        return LoRAModule(item["name"], item["path"], item.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r} must be name=path or a JSON object with name and path")
    return LoRAModule(name, path)


class ServedAdapters:
    def __init__(self, runtime_updates: bool = False):
        self.by_name: dict[str, LoRARequest] = {}
        self.runtime_updates = runtime_updates
        self._ids = itertools.count(1)

    def make(self, module: LoRAModule) -> LoRARequest:
        """The request for a module not yet served (the caller checks it with the engine, then adds it)."""
        return LoRARequest(module.name, next(self._ids), module.path, module.base_model_name)

    def add(self, request: LoRARequest) -> None:
        self.by_name[request.lora_name] = request

    def remove(self, name: str) -> LoRARequest | None:
        return self.by_name.pop(name, None)

    def get(self, name: str | None) -> LoRARequest | None:
        return self.by_name.get(name) if name is not None else None
