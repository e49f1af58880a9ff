"""vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter requests."""

from __future__ import annotations

from pydantic import Field

from server.protocol.fields import _Request


class LoadLoRAAdapterRequest(_Request):
    lora_name: str = Field(min_length=1, description="the name requests select the adapter by (their model field)")
    lora_path: str = Field(min_length=1, description="a PEFT adapter folder on the server: adapter_config.json "
                                                     "and adapter_model.safetensors")


class UnloadLoRAAdapterRequest(_Request):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; the name alone identifies an adapter here
