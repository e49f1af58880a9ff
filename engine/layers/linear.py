"""Megatron-style linear layers. Each parameter carries a `weight_loader` that copies this
rank's shard of a checkpoint tensor, so the loader never needs to know about sharding.

A layer's weight is float (the model's dtype), or, after quantize_weight(format), a GGUF block
format's raw blocks (engine/quant): a uint8 parameter [out rows, in / 32 * block bytes] loaded
from QuantizedTensor shards (a GGUF file's blocks as stored, float weights quantized at load by
--quantization int8 / int4, or a GPTQ / AWQ / compressed-tensors checkpoint converted at load),
multiplied by the format's matmul for the step's backend."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from engine.distributed.state import tp_all_reduce, tp_state
from engine.layers.context import get_forward_context
from engine.layers.lora import LoRAWeights
from engine.quant import BlockFormat, QuantizedTensor

logger = logging.getLogger(__name__)


def pack_weights(model: nn.Module, pack_linear_weight: Callable, pack_blocks: Callable) -> None:
    """Give every matmul weight of the model its packed copy, once the checkpoint is loaded: a
    float weight pack_linear_weight(weight) (the backend's), quantized blocks pack_blocks(format,
    blocks) (the triton backend repacks 4/8-bit blocks for the GPU: BlockFormat.pack), None where
    the plain weight is what the matmul reads. The plain copy is freed where nothing else reads it:
    a tied embedding reads its rows from the LM head's packed blocks (packed_rows) where the blocks
    were repacked, and keeps the weight where the head's copy is a float layout (oneDNN's)."""
    packers = [m for m in model.modules() if hasattr(m, "packed_weight")]
    for module in packers:
        fmt = getattr(module, "quant_format", None)
        module.packed_weight = (pack_linear_weight(module.weight) if fmt is None
                                else pack_blocks(fmt, module.weight))
    repacked = {id(m.weight): m.packed_weight for m in packers
                if m.packed_weight is not None and getattr(m, "quant_format", None) is not None}
    for module in model.modules():
        if hasattr(module, "packed_rows") and not hasattr(module, "packed_weight") and id(module.weight) in repacked:
            module.packed_rows = repacked[id(module.weight)]
    unpacked_users = {id(p) for m in model.modules() if not hasattr(m, "packed_weight")
                      and getattr(m, "packed_rows", None) is None for p in m.parameters(recurse=False)}
    for module in packers:
        if module.packed_weight is not None and id(module.weight) not in unpacked_users:
            module.weight.data = module.weight.data.new_empty(0)
    logger.info("weights resident: %s", weight_bytes_summary(model))


def weight_bytes_summary(model: nn.Module) -> str:
    """The weights' resident bytes: distinct parameter storages plus packed copies, with the
    share held in a block format (GGUF blocks or their repacked copies, bf16 matrices as stored)."""
    total = resident_bytes(model)
    quantized: dict[str, list[int]] = {}
    seen = set()  # a tied LM head's parameter is the embedding's: one matrix (unless it has its own copy)
    for m in model.modules():
        if getattr(m, "quant_format", None) is None:
            continue
        entry = quantized.setdefault(m.quant_format.name, [0, 0])
        if id(m.weight) not in seen:  # by the parameter: freed blocks (packed copies) all have address 0
            seen.add(id(m.weight))
            entry[0] += 1
            entry[1] += m.weight.nbytes
        packed = getattr(m, "packed_weight", None)
        entry[1] += packed.nbytes if packed is not None else 0
    parts = ", ".join(f"{n} matrices {fmt} {b / 2**20:.1f} MiB" for fmt, (n, b) in sorted(quantized.items()))
    return f"{total / 2**20:.1f} MiB" + (f" (as blocks: {parts})" if parts else "")


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`: what the process really holds, so a view
    into a larger tensor, or a tied weight counted twice, would show."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def resident_bytes(model: nn.Module) -> int:
    """The weights' bytes in memory: each distinct parameter storage once (a tied matrix is one),
    plus the packed copies."""
    return storage_bytes(model.parameters()) + packed_bytes(model)


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the packed weights pack_weights made (not among the model's parameters)."""
    return sum(m.packed_weight.nbytes for m in model.modules() if getattr(m, "packed_weight", None) is not None)


def _param(*shape: int, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.weight_loader = loader
    return p


def block_parameter(weight: nn.Parameter, fmt: BlockFormat) -> nn.Parameter:
    """A float weight's replacement holding `fmt`'s raw blocks for the same rows, zero-filled (a
    zero block dequantizes to zeros: a vocabulary's padding rows), with the same weight_loader."""
    rows, in_features = weight.shape
    blocks = nn.Parameter(torch.zeros(rows, fmt.row_bytes(in_features), dtype=torch.uint8, device=weight.device),
                          requires_grad=False)
    blocks.weight_loader = weight.weight_loader
    blocks.quant_format = fmt
    return blocks


def copy_rows(param: nn.Parameter, offset: int, size: int, loaded) -> None:
    """param rows offset..offset + size <- `loaded` (a float tensor, or a QuantizedTensor for a
    quantized parameter: then its blocks, as stored)."""
    quantized = isinstance(loaded, QuantizedTensor)
    if quantized != (param.dtype == torch.uint8):
        raise ValueError(f"a {'quantized' if quantized else 'float'} checkpoint tensor cannot load into a "
                         f"{'quantized' if param.dtype == torch.uint8 else 'float'} weight")
    if quantized and loaded.format is not param.quant_format:
        raise ValueError(f"a {loaded.format.name} tensor cannot load into a {param.quant_format.name} weight")
    param.data.narrow(0, offset, size).copy_(loaded.blocks if quantized else loaded)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter "
                         f"{tuple(param.shape)}")
    param.data.copy_(loaded)


class _Linear(nn.Module):
    packed_weight = None  # set by pack_weights
    lora: LoRAWeights | None = None  # adapter slots, set where LoRA serving is on (engine/runner/lora_slots.py)
    quant_format: BlockFormat | None = None  # set by quantize_weight
    activations: str | None = None  # "int16" / "int8": the cpu backend quantizes them (the runner sets it)

    def quantize_weight(self, fmt: BlockFormat) -> None:
        """Hold the weight as `fmt`'s raw blocks from now on (before the checkpoint loads)."""
        in_features = self.weight.shape[1]
        if in_features % fmt.block_size:
            raise ValueError(f"{in_features} inputs per rank are not whole {fmt.name} blocks of {fmt.block_size}: "
                             "use a tensor-parallel size that keeps them whole, or float weights (a GGUF with "
                             "--gguf-weights dequantize; a float checkpoint without --quantization)")
        self.weight = block_parameter(self.weight, fmt)
        self.quant_format = fmt

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        context = get_forward_context()
        backend = context.backend
        if self.quant_format is not None:
            y = self.quant_format.linear(x, self.weight, bias, backend.name, self.activations, self.packed_weight)
        else:
            y = backend.linear(x, self.weight, bias, self.packed_weight)
        if self.lora is not None and self.lora.adapts(context.lora_step_slots):  # (no slots: no LoRA step)
            # Before a row-parallel reduction too: B A x is linear in this rank's share of x.
            self.lora.add_to(y, x, context.lora_slots)
        return y


class ColumnParallelLinear(_Linear):
    """y = x A^T with A's output rows split across ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        tp = tp_state()
        assert out_features % tp.size == 0, f"{out_features} output features do not split over {tp.size} ranks"
        self.out_per_rank = out_features // tp.size
        self.in_features = in_features
        self.weight = _param(self.out_per_rank, in_features, loader=self.weight_loader)
        self.bias = _param(self.out_per_rank, loader=self.weight_loader) if bias else None

    def output_rows(self, shard_id=None) -> tuple[int, int, int, int]:
        """(part, first row in this rank's weight, rows, first row in the checkpoint tensor) of
        checkpoint module `shard_id` (one module: the whole output)."""
        return 0, 0, self.out_per_rank, tp_state().rank * self.out_per_rank

    def lora_slices(self) -> tuple[int, ...]:
        """This rank's output rows of each LoRA part (a fused projection has one per checkpoint module)."""
        return (self.out_per_rank,)

    def lora_shard(self, shard_id, a: torch.Tensor, b: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(part, this rank's A, this rank's B) of checkpoint module `shard_id`'s adapter matrices
        A [r, in] and B [out, r]: what the base weight's shard needs, B's rows of this rank's outputs."""
        part, _, size, start = self.output_rows(shard_id)
        return part, a, b.narrow(0, start, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _, offset, size, start = self.output_rows(shard_id)
        copy_rows(param, offset, size, loaded.narrow(0, start, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stored as one matrix (gate and up projections)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias)

    def output_rows(self, shard_id: int) -> tuple[int, int, int, int]:
        tp = tp_state()
        size = self.out_sizes[shard_id] // tp.size
        return shard_id, sum(self.out_sizes[:shard_id]) // tp.size, size, tp.rank * size

    def lora_slices(self) -> tuple[int, ...]:
        return tuple(s // tp_state().size for s in self.out_sizes)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections. Query heads split evenly; with fewer KV heads than ranks,
    each KV head is replicated on the ranks whose query heads use it."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp = tp_state()
        assert num_heads % tp.size == 0, f"{num_heads} attention heads do not split over {tp.size} ranks"
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.size
        if num_kv_heads >= tp.size:
            assert num_kv_heads % tp.size == 0, f"{num_kv_heads} KV heads do not split over {tp.size} ranks"
            self.num_kv_heads = num_kv_heads // tp.size
        else:
            assert tp.size % num_kv_heads == 0, f"{tp.size} ranks cannot share {num_kv_heads} KV heads evenly"
            self.num_kv_heads = 1
        self.total_kv_heads = num_kv_heads
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp.size
        super().__init__(hidden, out, bias)

    def output_rows(self, shard_id: str) -> tuple[int, int, int, int]:
        tp = tp_state()
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            return 0, 0, q_size, tp.rank * q_size
        # Which KV head serves this rank's query heads: rank // (ranks per KV head).
        kv_head = (tp.rank * self.total_kv_heads // tp.size if self.total_kv_heads < tp.size
                   else tp.rank * self.num_kv_heads)
        offset = q_size if shard_id == "k" else q_size + kv_size
        return "qkv".index(shard_id), offset, kv_size, kv_head * self.head_dim

    def lora_slices(self) -> tuple[int, ...]:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return q_size, kv_size, kv_size


class RowParallelLinear(_Linear):
    """y = x A^T with A's input columns split across ranks; partial sums are all-reduced, unless
    `reduce_results` is False: then the caller adds more partial sums and reduces once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce_results: bool = True):
        super().__init__()
        tp = tp_state()
        assert reduce_results or not bias, "a bias is added after the reduction"
        self.reduce_results = reduce_results
        assert in_features % tp.size == 0, f"{in_features} input features do not split over {tp.size} ranks"
        self.in_per_rank = in_features // tp.size
        self.out_features = out_features
        self.weight = _param(out_features, self.in_per_rank, loader=self.weight_loader)
        # The bias is added once, after the reduction (on every rank, identically).
        self.bias = _param(out_features, loader=default_weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rank = tp_state().rank
        copy_rows(param, 0, param.shape[0], loaded.narrow(1, rank * self.in_per_rank, self.in_per_rank))

    def lora_slices(self) -> tuple[int, ...]:
        return (self.out_features,)

    def lora_shard(self, shard_id, a: torch.Tensor, b: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Row-parallel: A's input columns of this rank; each rank adds B A x of its share of x."""
        return 0, a.narrow(1, tp_state().rank * self.in_per_rank, self.in_per_rank), b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, None)
        if not self.reduce_results:
            return y
        y = tp_all_reduce(y)
        return y + self.bias if self.bias is not None else y
