"""The KV cache at start-up: how many blocks fit the memory budget (the functions `engine plan
serve` uses; on CUDA vLLM's rule, from the largest step's activation peak and the CUDA graphs'
memory, which the model runner measures), the largest step itself as plain data, and the
per-layer cache tensors."""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from engine.config import CPU_KV_CACHE_MEMORY, EngineConfig
from engine.distributed.state import min_over_ranks, tp_state
from engine.planning import ModelSpec, kv_budget_bytes, kv_bytes_per_token, kv_capacity_tokens
from engine.planning.units import MiB
from engine.sampling_params import SamplingParams
from engine.scheduler_output import NewRequestData, SchedulerOutput

logger = logging.getLogger(__name__)


def stage_kv_bytes_per_token(spec: ModelSpec, num_stage_layers: int, kv_dtype: torch.dtype) -> int:
    """On this rank: its TP share of the KV heads, for the layers of its pipeline stage."""
    stage = dataclasses.replace(spec, num_layers=num_stage_layers)
    return kv_bytes_per_token(stage, kv_dtype.itemsize, tp=tp_state().size)


def num_kv_blocks(config: EngineConfig, device: torch.device, bytes_per_token: int,
                  cuda_budget: Callable[[], int]) -> int:
    """Blocks that fit the memory budget (the same functions `engine plan serve` uses):
    num_kv_blocks if given, else kv_cache_memory if given (any device), else on CUDA what
    gpu_memory_utilization leaves (`cuda_budget()`, see cuda_kv_budget), on CPU CPU_KV_CACHE_MEMORY."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    knob = "kv_cache_memory"
    if config.kv_cache_memory is not None:
        budget = config.kv_cache_memory
    elif device.type == "cuda":
        budget = cuda_budget()
        knob = "gpu_memory_utilization (or set kv_cache_memory / num_kv_blocks)"
    else:
        budget = CPU_KV_CACHE_MEMORY
    tokens = kv_capacity_tokens(budget, bytes_per_token, config.block_size)
    if tokens < config.block_size:
        raise ValueError(
            f"the KV cache budget ({budget} bytes) holds no block of {config.block_size} tokens at "
            f"{bytes_per_token} bytes per token: raise {knob}")
    # Every rank of a parallel replica shares one block table: keep what fits on all of them.
    return min_over_ranks(tokens // config.block_size)


def cuda_kv_budget(device: torch.device, utilization: float, activation_peak: int, graph_bytes: int,
                   block_bytes: int) -> int:
    """vLLM's rule: total x gpu_memory_utilization, minus everything in use as
    torch.cuda.mem_get_info sees it once the weights are loaded (other processes, the CUDA context
    and NCCL included), minus the activation peak of the largest step, minus the CUDA graphs."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    budget = kv_budget_bytes(total, utilization, in_use + activation_peak + graph_bytes)
    logger.info("KV cache budget %.0f MiB = %.2f x %.0f MiB total - %.0f MiB in use - %.0f MiB activation peak "
                "- %.0f MiB CUDA graphs", budget / MiB, utilization, total / MiB, in_use / MiB, activation_peak / MiB,
                graph_bytes / MiB)
    if budget < block_bytes:
        raise ValueError(
            f"no KV cache block fits on {device}: {utilization} x {total / MiB:.0f} MiB total leaves "
            f"{budget / MiB:.0f} MiB after {in_use / MiB:.0f} MiB in use (weights, CUDA context, other processes), a "
            f"{activation_peak / MiB:.0f} MiB activation peak and {graph_bytes / MiB:.0f} MiB of CUDA graphs; "
            "raise gpu_memory_utilization, lower max_num_batched_tokens / max_num_seqs, set enforce_eager, or "
            "set kv_cache_memory / num_kv_blocks")
    return budget


def largest_step(config: EngineConfig, max_model_len: int) -> tuple[SchedulerOutput, int]:
    """The largest step the scheduler can send, and the blocks it needs: a full token budget over
    max_num_seqs sequences (as many as the budget allows), all sampling with top-k/top-p, penalties
    and logprobs, the first one's whole chunk also scoring prompt logprobs."""
    bs = config.block_size
    n = min(config.max_num_batched_tokens, max_model_len)
    num_seqs = min(config.max_num_seqs, n)
    lengths = [n - num_seqs + 1] + [1] * (num_seqs - 1)
    top = config.max_logprobs
    params = SamplingParams(max_tokens=1, temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, presence_penalty=0.5,
                            repetition_penalty=1.1, seed=0, logprobs=top)
    # Prompt logprobs score every prompt token but the first: only a prompt of two or more has any.
    first = dataclasses.replace(params, prompt_logprobs=top) if lengths[0] > 1 else params
    new, block = [], 0
    for i, m in enumerate(lengths):
        blocks = list(range(block, block + -(-m // bs)))
        block += len(blocks)
        new.append(NewRequestData(f"profile#{i}", 0, [0] * m, [], first if i == 0 else params, blocks, 0))
    return SchedulerOutput(new_reqs=new, num_scheduled_tokens=[(r.req_id, len(r.prompt_token_ids)) for r in new]), block


def allocate_kv_cache(model, backend, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                      device: torch.device) -> list[torch.Tensor]:
    """Bind each attention layer's K and V cache of `num_blocks` blocks; returns them all."""
    caches = []
    for layer in model.layers():
        attn = layer.self_attn.attn
        shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
        attn.k_cache, attn.v_cache = backend.allocate_kv_cache(*shape, kv_dtype, device)
        caches += [attn.k_cache, attn.v_cache]
    if device.type == "cpu":
        # A zeroed CPU tensor is calloc'ed: its pages are mapped only when first written, and
        # the block pool hands out the least recently freed block first, so the process would
        # grow toward its KV budget for as long as it serves. Touch every page now: memory
        # is committed (or refused) at start, and RSS afterwards says what serving costs.
        for cache in caches:
            cache.zero_()
    return caches


def release_kv_cache(model) -> None:
    for layer in model.layers():
        layer.self_attn.attn.k_cache = layer.self_attn.attn.v_cache = None
