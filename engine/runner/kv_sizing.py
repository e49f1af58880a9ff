"""The model runner's KV cache at start-up: how many blocks fit the memory budget (the functions
`engine plan serve` uses; on CUDA vLLM's rule, after profiling the largest step and measuring the
CUDA graphs), and the per-layer cache tensors. A mixin of ModelRunner (engine/runner/model_runner.py),
which runs the steps: it reads the runner's model, config, device, dtypes and backend, and its
profile run is one real step."""

from __future__ import annotations

import dataclasses
import logging

import torch

from engine.config import CPU_KV_CACHE_MEMORY
from engine.distributed.state import min_over_ranks, tp_state
from engine.planning import kv_budget_bytes, kv_bytes_per_token, kv_capacity_tokens
from engine.sampling_params import SamplingParams
from engine.scheduler_output import NewRequestData, SchedulerOutput

logger = logging.getLogger(__name__)


class KVCacheSizing:
    def kv_bytes_per_token(self) -> int:
        """On this rank: its TP share of the KV heads, for the layers of its pipeline stage."""
        stage = dataclasses.replace(self.spec, num_layers=len(self.model.layers()))
        return kv_bytes_per_token(stage, self.kv_dtype.itemsize, tp=tp_state().size)

    def _size_kv_cache(self) -> int:
        """Blocks that fit the memory budget (the same functions `engine plan serve` uses):
        num_kv_blocks if given, else kv_cache_memory if given (any device), else on CUDA what
        gpu_memory_utilization leaves (_cuda_kv_budget), on CPU CPU_KV_CACHE_MEMORY."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        knob = "kv_cache_memory"
        if self.config.kv_cache_memory is not None:
            budget = self.config.kv_cache_memory
        elif self.device.type == "cuda":
            budget = self._cuda_kv_budget()
            knob = "gpu_memory_utilization (or set kv_cache_memory / num_kv_blocks)"
        else:
            budget = CPU_KV_CACHE_MEMORY
        tokens = kv_capacity_tokens(budget, self.kv_bytes_per_token(), self.block_size)
        if tokens < self.block_size:
            raise ValueError(
                f"the KV cache budget ({budget} bytes) holds no block of {self.block_size} tokens at "
                f"{self.kv_bytes_per_token()} bytes per token: raise {knob}")
        # Every rank of a parallel replica shares one block table: keep what fits on all of them.
        return min_over_ranks(tokens // self.block_size)

    def _cuda_kv_budget(self) -> int:
        """vLLM's rule: total x gpu_memory_utilization, minus everything in use as
        torch.cuda.mem_get_info sees it once the weights are loaded (other processes, the CUDA
        context and NCCL included), minus the activation peak of the largest step (profiled), minus
        the CUDA graphs (captured once on the profile's cache to measure them)."""
        dev = self.device
        activation_peak = self._profile_run()
        graph_bytes = 0
        if not self._graphs_off():
            graph_bytes = self._capture_graphs()
            self.graphs.release()
        self.kv_caches = []  # the profile's throwaway cache
        for layer in self.model.layers():
            layer.self_attn.attn.k_cache = layer.self_attn.attn.v_cache = None
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        in_use = total - free
        util = self.config.gpu_memory_utilization
        budget = kv_budget_bytes(total, util, in_use + activation_peak + graph_bytes)
        mib = 1 << 20
        logger.info("KV cache budget %.0f MiB = %.2f x %.0f MiB total - %.0f MiB in use - %.0f MiB activation peak "
                    "- %.0f MiB CUDA graphs", budget / mib, util, total / mib, in_use / mib, activation_peak / mib,
                    graph_bytes / mib)
        if budget < self.kv_bytes_per_token() * self.block_size:
            raise ValueError(
                f"no KV cache block fits on {dev}: {util} x {total / mib:.0f} MiB total leaves {budget / mib:.0f} MiB "
                f"after {in_use / mib:.0f} MiB in use (weights, CUDA context, other processes), a "
                f"{activation_peak / mib:.0f} MiB activation peak and {graph_bytes / mib:.0f} MiB of CUDA graphs; "
                "raise gpu_memory_utilization, lower max_num_batched_tokens / max_num_seqs, set enforce_eager, or "
                "set kv_cache_memory / num_kv_blocks")
        return budget

    def _profile_run(self) -> int:
        """Run the largest step the scheduler can send on a throwaway cache and return its
        activation peak (bytes allocated beyond what stays allocated): a full token budget over
        max_num_seqs sequences (as many as the budget allows), all sampling with top-k/top-p,
        penalties and logprobs, the first one's whole chunk also scoring prompt logprobs. The
        throwaway cache stays bound to the layers (the graph probe reads it)."""
        dev = self.device
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        num_seqs = min(self.config.max_num_seqs, n)
        lengths = [n - num_seqs + 1] + [1] * (num_seqs - 1)
        self.num_blocks = sum(-(-m // self.block_size) for m in lengths)
        self._allocate_kv_cache()
        top = self.config.max_logprobs
        params = SamplingParams(max_tokens=1, temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, presence_penalty=0.5,
                                repetition_penalty=1.1, seed=0, logprobs=top)
        # Prompt logprobs score every prompt token but the first: only a prompt of two or more has any.
        first = dataclasses.replace(params, prompt_logprobs=top) if lengths[0] > 1 else params
        new, block = [], 0
        for i, m in enumerate(lengths):
            blocks = list(range(block, block + -(-m // self.block_size)))
            block += len(blocks)
            new.append(NewRequestData(f"profile#{i}", 0, [0] * m, [], first if i == 0 else params, blocks, 0))
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        self.execute_model(SchedulerOutput(new_reqs=new, num_scheduled_tokens=[(r.req_id, len(r.prompt_token_ids))
                                                                               for r in new]))
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        self.update_states(SchedulerOutput(finished_req_ids=[r.req_id for r in new]))
        self.inputs.reset()  # its block ids name blocks of the throwaway cache
        return max(peak, 0)

    def _allocate_kv_cache(self) -> None:
        self.kv_caches = []
        for layer in self.model.layers():
            attn = layer.self_attn.attn
            shape = (self.num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
            attn.k_cache, attn.v_cache = self.backend.allocate_kv_cache(*shape, self.kv_dtype, self.device)
            self.kv_caches += [attn.k_cache, attn.v_cache]
        if self.device.type == "cpu":
            # A zeroed CPU tensor is calloc'ed: its pages are mapped only when first written, and
            # the block pool hands out the least recently freed block first, so the process would
            # grow toward its KV budget for as long as it serves. Touch every page now: memory
            # is committed (or refused) at start, and RSS afterwards says what serving costs.
            for cache in self.kv_caches:
                cache.zero_()
