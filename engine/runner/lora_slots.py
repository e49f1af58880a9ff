"""The runner's LoRA adapters: a fixed number of slots in every adapted linear layer (max_loras),
filled from adapters kept in CPU memory (up to max_cpu_loras, least recently used dropped first),
which are read from their PEFT folders the first time a step needs them. A step's adapters get
slots before its forward (the scheduler never runs more than max_loras at once); a slot whose
adapter no running step uses is refilled, least recently used first.

Every rank of a tensor-parallel or pipeline-parallel engine keeps its own: each fills its layers'
shards from the same folder, as it loads the base checkpoint."""

from __future__ import annotations

import collections
import logging

import torch

from engine.config import EngineConfig
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.layers.lora import LoRAWeights
from engine.loading.lora_adapter import AdapterError, LoRAAdapter, check_adapter, read_adapter, target_shapes
from engine.request import LoRARequest

logger = logging.getLogger(__name__)

# The model's linear layers adapters may reach (fused names; a MoE model's experts are not linears).
ADAPTED_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class AdapterSlots:
    def __init__(self, model: torch.nn.Module, hf_config, config: EngineConfig, dtype: torch.dtype,
                 device: torch.device):
        self.model, self.targets, self.dtype = model, target_shapes(hf_config), dtype
        self.max_loras, self.max_rank = config.max_loras, config.max_lora_rank
        self.cpu_capacity = config.max_cpu_loras or config.max_loras
        self.layers = {}
        for name, module in model.named_modules():
            if name.rpartition(".")[2] not in ADAPTED_LAYERS or "shared_expert" in name:
                continue
            if isinstance(module, ColumnParallelLinear):
                in_features = module.in_features
            elif isinstance(module, RowParallelLinear):
                in_features = module.in_per_rank
            else:
                continue
            module.lora = LoRAWeights(in_features, module.lora_slices(), self.max_loras, self.max_rank, dtype, device)
            self.layers[name] = module
        self.owner: list[int | None] = [None] * self.max_loras  # adapter id per slot
        self.slot_of: dict[int, int] = {}
        self.last_used = [0] * self.max_loras
        self.steps = 0
        self.cached: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()
        logger.info("LoRA: %d slots of rank %d in %d layers, %.1f MiB", self.max_loras, self.max_rank,
                    len(self.layers), sum(m.lora.nbytes for m in self.layers.values()) / 2**20)

    def slots(self, adapters: dict[int, LoRARequest]) -> tuple[dict[int, int], dict[int, str]]:
        """The slot of each adapter a step runs (by id), filling slots as needed; and, by id, why an
        adapter could not be read (its folder changed or went away since admission checked it: the
        runner fails its streams, the others run)."""
        self.steps += 1
        unreadable = {}
        for lora_id, request in adapters.items():
            slot = self.slot_of.get(lora_id)
            if slot is None:
                try:
                    adapter = self.load(request)
                except (AdapterError, OSError) as e:
                    unreadable[lora_id] = f"lora_request: {e}"
                    continue
                slot = self._take_slot(adapters)
                self._fill(slot, request, adapter)
            self.last_used[slot] = self.steps
        return self.slot_of, unreadable

    def _take_slot(self, needed: dict[int, LoRARequest]) -> int:
        if None in self.owner:
            return self.owner.index(None)
        idle = [s for s, owner in enumerate(self.owner) if owner not in needed]
        assert idle, f"a step runs more than max_loras ({self.max_loras}) adapters"
        slot = min(idle, key=self.last_used.__getitem__)
        del self.slot_of[self.owner[slot]]
        self.owner[slot] = None
        return slot

    def _fill(self, slot: int, request: LoRARequest, adapter: LoRAAdapter) -> None:
        for module in self.layers.values():
            module.lora.clear(slot)
        for name, (a, b) in adapter.weights.items():
            target, shard = self.model.checkpoint_target(name + ".weight")
            module = self.layers.get(target.removesuffix(".weight"))
            if module is None:
                continue  # a layer of another pipeline stage
            part, a, b = module.lora_shard(shard, a, b)
            module.lora.set_part(slot, part, a, b, adapter.info.scaling)
        self.owner[slot] = request.lora_int_id
        self.slot_of[request.lora_int_id] = slot

    def load(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter's matrices, from the CPU cache or its folder."""
        adapter = self.cached.get(request.lora_int_id)
        if adapter is not None:
            self.cached.move_to_end(request.lora_int_id)
            return adapter
        info = check_adapter(request.lora_path, self.targets, self.max_rank)
        adapter = self.cached[request.lora_int_id] = read_adapter(request.lora_path, info, self.dtype)
        while len(self.cached) > self.cpu_capacity:
            self.cached.popitem(last=False)
        return adapter
