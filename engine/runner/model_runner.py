"""ModelRunner: owns the weights, the KV cache tensors and its copy of every running stream;
applies each step's SchedulerOutput to those copies, lays the batch out as flat rows in persistent
buffers (engine/runner/step_inputs.py: one non-blocking copy a step, the block tables kept on the device),
runs one forward pass (a captured CUDA graph for decode steps, engine/runner/cuda_graphs.py), samples the
whole batch at once and returns token ids (and the logprobs asked for), never logits. Under
pipeline parallelism only the last stage computes logits and samples (its TP rank 0); the other
ranks run their share of the forward and return None. Sizing and allocating the KV cache at
start-up are functions of engine/runner/kv_sizing.py, given what the runner measures; sampling,
pooling and prompt logprobs are the sampling rank's StepOutputs (engine/runner/step_outputs.py); a
stream's copy is engine/runner/runner_streams.py's CachedRequestState."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import torch

import kernels
from engine.config import EngineConfig
from engine.distributed.state import pp_state, tp_state
from engine.layers.context import AttentionMetadata, forward_context
from engine.layers.linear import pack_weights
from engine.layers.moe import pack_experts
from engine.loading.loader import ModelSource
from engine.loading.weights import checkpoint_tensors, keeps_bf16, load_weights
from engine.models import cpu_fused_layers
from engine.models.registry import model_class
from engine.planning import ModelSpec
from engine.quant import activations
from engine.runner.cpu_threads import LoadFollower, check_openmp_spin, usable_cpus
from engine.runner.cuda_graphs import DecodeGraphs, capture_sizes
from engine.runner.host_memory import keep_freed_memory
from engine.runner.lora_slots import AdapterSlots
from engine.runner import kv_sizing
from engine.runner.runner_streams import CachedRequestState
from engine.runner.sampler import Sampler
from engine.runner.step_inputs import StepInputs
from engine.runner.step_outputs import StepOutputs, offer_grammars
from engine.scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device; use device='cpu'")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, stored: torch.dtype | str | None = None) -> torch.dtype:
    """dtype -> the dtype weights and activations compute in. "auto": bfloat16 on CUDA; on a CPU,
    bfloat16 when the checkpoint is stored in 16 bits or fewer (`stored`, its config's dtype: a
    bf16/fp16 folder, a quantized GGUF) and the CPU multiplies bf16 natively, else float32. So a
    float32 checkpoint keeps float32 (transformers' own "auto" keeps the stored dtype too), a CPU
    without native bf16 keeps float32 (its bf16 GEMM is several times slower), and where it has it
    the 16-bit checkpoints take the faster path, since a native bf16 GEMM runs about twice the
    float32 one at no perplexity cost (BENCHMARKS.md, "Weight formats: quality"); vLLM's CPU backend likewise runs fp16
    checkpoints as bf16."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    if isinstance(stored, str):
        stored = _DTYPES.get(stored)
    sixteen_bit = stored in (torch.bfloat16, torch.float16)
    return torch.bfloat16 if sixteen_bit and _native_bf16_matmul() else torch.float32


def _native_bf16_matmul() -> bool:
    from kernels import cpu_ops

    return cpu_ops.native_bf16_matmul()


def resolve_kv_dtype(name: str, dtype: torch.dtype, backend: str, device: torch.device) -> torch.dtype:
    """kv_cache_dtype -> the cache's element dtype: "auto" is the model's, "fp8" is e4m3 (vLLM's
    meaning), where the backend can keep it (else ValueError naming the flag)."""
    if name == "auto":
        return dtype
    if name == "fp8":
        error = kernels.fp8_kv_cache_error(backend, device)
        if error is not None:
            raise ValueError(f"kv_cache_dtype 'fp8' (--kv-cache-dtype fp8) {error}; "
                             "use kv_cache_dtype='auto' or a 16-bit kv_cache_dtype")
        return torch.float8_e4m3fn
    return _DTYPES[name]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@dataclasses.dataclass
class StepBatch:
    """What one step's forward and sampling need beyond the staged tensors: the host-side lists."""

    num_tokens: int  # real tokens; rows past them are padding
    num_padded_tokens: int
    num_seqs: int
    width: int  # blocks of the longest sequence: the block table's width on CPU
    sample_streams: list[CachedRequestState]  # one per sample row, in row order
    # Speculating streams, after the sample rows: (stream, its drafts), each with 1 + len(drafts)
    # logits rows, in order (the last real token's, then each draft's).
    verify_streams: list[tuple[CachedRequestState, list[int]]]
    prompt_rows: list  # (state, first prompt token scored, first row, end row)
    pool_chunks: list  # embedding requests: rows to sum (mean)
    pool_ends: list  # embedding requests: the row that finishes one
    graph_size: int | None  # the padded batch of a CUDA graph (or its CPU emulation); None: eager
    meta: AttentionMetadata | None = None  # the eager forward's, set once the inputs are on the device
    lora_step_slots: tuple[int, ...] = ()  # the adapter slots some token runs (lora_slots are staged; eager)
    # Streams whose adapter could not be read (its folder went away): run without it, then failed.
    broken_adapters: dict[str, str] = dataclasses.field(default_factory=dict)


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource):
        self.config = config
        self.requests: dict[str, CachedRequestState] = {}
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, getattr(source.hf_config, "dtype", None))
        self.threads: LoadFollower | None = None  # the default CPU thread count, following other processes' load
        if self.device.type == "cpu":
            keep_freed_memory()
            if config.num_threads is None:
                self.threads = LoadFollower(usable_cpus())
            else:
                torch.set_num_threads(config.num_threads)
            check_openmp_spin()
        # The kernels, chosen once: the backend's name (for reports) and its ops, which every layer
        # reaches through the forward context execute_model sets.
        self.attn_backend = kernels.resolve_backend(config.attention_backend, self.device.type)
        self.backend = kernels.get_backend(self.attn_backend)
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype, self.attn_backend, self.device)
        if config.quantization == "fp8" and self.attn_backend == "cpu":
            raise ValueError("quantization 'fp8' (--quantization fp8): the cpu backend has no fp8 matmul; serve fp8 "
                             "weights on a CUDA GPU (triton backend), use --quantization int8 (its CPU kernels), or "
                             "--attention-backend torch (dequantizes each call: slow)")
        hf = source.hf_config
        self.hf_config = hf
        self.block_size = config.block_size
        self.spec = ModelSpec.from_hf_config(hf.to_dict())
        model_len = getattr(hf, "max_position_embeddings", None) or 2048
        limit = self.spec.position_limit or model_len  # a stretching rope scaling serves its factor's length
        if config.max_model_len is not None and config.max_model_len > limit:
            stretched = f", {limit} with its rope scaling" if limit > model_len else ""
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings "
                             f"({model_len}{stretched}); use a value <= {limit}")
        self.max_model_len = config.max_model_len or model_len
        window = self.spec.sliding_window  # None where the layers mask their own window (Gemma)
        if window and window < self.max_model_len:
            # Attention here is always full; within the window, full and sliding attention agree.
            logger.warning("limiting max_model_len to the model's sliding window (%d tokens)", window)
            self.max_model_len = window
        with torch.device(self.device), _default_dtype(self.dtype):
            # A pipeline stage builds (and loads) only its own layers; one process builds all.
            # The rotary table serves max_model_len: a length-dependent rope scaling (longrope, dynamic) is fixed
            # by it, as vLLM fixes it (--max-model-len within the original length: LongRoPE's short factors).
            self.model = model_class(hf.model_type)(hf, max_positions=self.max_model_len,
                                                    layer_range=pp_state().layer_range)
        load_weights(self.model, checkpoint_tensors(
            source, keeps_bf16(config.cpu_bf16_weights, self.backend.name, self.dtype)))
        pack_weights(self.model, self.backend.pack_linear_weight,
                     lambda fmt, blocks: fmt.pack(blocks, self.backend.name))
        pack_experts(self.model, self.backend.pack_moe_weights)
        self._quantized_activations(source)
        self._fuse_cpu_layers()
        self.adapters = AdapterSlots(self.model, hf, config, self.dtype, self.device) if config.enable_lora else None
        if self.threads is not None:  # helpers on shared CPUs join the C++ kernels' loops: worth it where
            # those hold the matmuls (engine/runner/cpu_threads.py)
            self.threads.kernel_matmuls = self.backend.name == "cpu" and any(
                getattr(m, "quant_format", None) is not None for m in self.model.modules())
        self.model.eval()
        # Logits exist on the last stage only, gathered on each of its TP ranks; one of them samples.
        self.last_stage = pp_state().rank == pp_state().size - 1
        self.sampler = (Sampler(source.eos_token_ids, config.seed, self.device, self.backend.argmax)
                        if self.last_stage and tp_state().rank == 0 else None)
        self.source = source
        # Offered now, so that a server in this process compiles a grammar before the first step, not in it.
        self.grammar_offer = (offer_grammars(source.tokenizer, hf.vocab_size, source.eos_token_ids,
                                             self.backend.apply_token_bitmask, config)
                              if self.sampler is not None else None)
        self.outputs = (StepOutputs(self.sampler, self.grammar_offer, self.model.final_hidden)
                        if self.sampler is not None else None)
        max_tokens = max(self.backend.padded_num_tokens(config.max_num_batched_tokens), config.max_num_seqs)
        self.inputs = StepInputs(max_tokens, config.max_num_seqs, -(-self.max_model_len // self.block_size),
                                 self.device)
        self.graphs = DecodeGraphs(capture_sizes(config.cuda_graph_sizes, config.max_num_seqs),
                                   self._stage_dummy_decode, self._decode_forward)
        self._graph_error: str | None = None  # why capture failed, if it did
        graphs_off = self._graphs_off()
        if graphs_off and self.device.type == "cuda":
            logger.info("CUDA graphs off: %s; decode steps run eagerly", graphs_off)
        self._compile_triton_kernels()
        self.num_blocks = kv_sizing.num_kv_blocks(config, self.device, self.kv_bytes_per_token(), self._cuda_kv_budget)
        self._allocate_kv_cache()
        if not self._graphs_off():
            self._capture_graphs()

    def _quantized_activations(self, source) -> None:
        """cpu backend, a .gguf file: its block matmuls take int16 (or int8) activations at small
        steps where that pays (EngineConfig.cpu_gguf_activations; engine/quant/activations.py)."""
        if self.config.cpu_gguf_activations != "float" and self.backend.name == "cpu" and source.is_gguf:
            activations.mark(self.model, self.config.cpu_gguf_activations)

    def _fuse_cpu_layers(self) -> None:
        """cpu backend: small steps through every decoder layer in one C++ call where that is the
        modules' computation (engine/models/cpu_fused_layers.py says when)."""
        inner = getattr(self.model, "model", None)
        if not (self.config.cpu_fused_layers and self.backend.name == "cpu" and hasattr(inner, "fused_layers")):
            return
        why = cpu_fused_layers.unsupported(inner)
        if why is None:
            inner.fused_layers = cpu_fused_layers.CpuFusedLayers(inner)
        logger.info("decoder layers: %s", "one C++ call for small steps" if why is None
                    else f"modules op by op ({why})")

    def _compile_triton_kernels(self) -> None:
        """On CUDA, Triton compiles a kernel variant on its first launch (about a second each):
        compile every tile and split count a step can pick now, so no request waits on it mid-serving."""
        if self.device.type != "cuda" or self.backend.name != "triton":
            return
        from kernels import triton_ops

        attn = next(iter(self.model.layers())).self_attn
        ffn = {m.gate_up_proj.weight.shape[0] // 2 for m in self.model.modules() if hasattr(m, "gate_up_proj")}
        ffn |= {m.w13.shape[1] // 2 for m in self.model.modules() if isinstance(getattr(m, "w13", None), torch.Tensor)}
        start = time.perf_counter()
        launches = triton_ops.warmup(num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
                                     block_size=self.block_size, max_model_len=self.max_model_len, dtype=self.dtype,
                                     device=self.device, kv_cache_dtype=self.kv_dtype,
                                     hidden_size=self.model.config.hidden_size, intermediate_sizes=tuple(sorted(ffn)),
                                     qk_norm=attn.qk_norm, attention_features=self._attention_features())
        # Quantized linears (kernels/triton_quant.py on GGUF blocks, triton_quant_packed.py on their
        # repacked copies): every tile and K split up to a full token budget.
        from engine.layers.linear import RowParallelLinear
        from kernels import triton_quant, triton_quant_packed

        blocks, packed = [], []
        for m in self.model.modules():
            if getattr(m, "quant_format", None) is None:
                continue
            bias = None if isinstance(m, RowParallelLinear) else getattr(m, "bias", None)  # its matmul's bias
            if getattr(m, "packed_weight", None) is not None:
                packed.append((m.packed_weight, bias))
            else:
                blocks.append((m.quant_format.name, m.weight, bias))
        budget = self.config.max_num_batched_tokens
        launches += triton_quant.warmup(blocks, self.dtype, self.device, budget)
        launches += triton_quant_packed.warmup(packed, self.dtype, self.device, budget)
        logger.info("Triton kernels compiled for every step shape: %d launches, %.1f s", launches,
                    time.perf_counter() - start)

    def _attention_features(self) -> tuple:
        """Each (sliding window, soft cap) some layer attends with: one Triton variant each (Gemma's
        window layers and full layers differ)."""
        return tuple(dict.fromkeys((layer.self_attn.attn.sliding_window, layer.self_attn.attn.logits_soft_cap)
                                   for layer in self.model.layers()))

    def _graphs_off(self) -> str | None:
        """Why decode steps cannot be captured here (None: they are)."""
        if self.device.type != "cuda":
            return "not a CUDA device"
        if self._graph_error is not None:
            return f"capture failed ({self._graph_error})"
        if self.config.enforce_eager:
            return "enforce_eager"
        if tp_state().size > 1 or pp_state().size > 1:
            return "tensor/pipeline parallel steps (their collectives and sends are not captured)"
        if self.attn_backend != "triton":
            return f"the {self.attn_backend} attention backend plans its steps on the host"
        if not self.graphs.sizes:
            return "no cuda_graph_sizes"
        return None

    def _capture_graphs(self) -> int:
        """Capture the decode graphs against the bound KV cache; their device memory, or 0 if
        capture failed (decode then runs eagerly, with a warning)."""
        try:
            return self.graphs.capture(self.device)
        except Exception as e:  # an op that cannot be captured: serve eagerly rather than not at all
            logger.warning("capturing CUDA graphs failed (%r); decode steps run eagerly", e)
            self._graph_error = repr(e)
            self.graphs.release()
            return 0

    def kv_bytes_per_token(self) -> int:
        return kv_sizing.stage_kv_bytes_per_token(self.spec, len(self.model.layers()), self.kv_dtype)

    def _allocate_kv_cache(self) -> None:
        self.kv_caches = kv_sizing.allocate_kv_cache(self.model, self.backend, self.num_blocks, self.block_size,
                                                     self.kv_dtype, self.device)

    def _cuda_kv_budget(self) -> int:
        """What gpu_memory_utilization leaves for the KV cache (kv_sizing.cuda_kv_budget), from the
        largest step's activation peak and the CUDA graphs' memory, measured here."""
        activation_peak = self._profile_run()
        graph_bytes = 0
        if not self._graphs_off():
            graph_bytes = self._capture_graphs()
            self.graphs.release()
        self.kv_caches = []  # the profile's throwaway cache
        kv_sizing.release_kv_cache(self.model)
        return kv_sizing.cuda_kv_budget(self.device, self.config.gpu_memory_utilization, activation_peak, graph_bytes,
                                        self.kv_bytes_per_token() * self.block_size)

    def _profile_run(self) -> int:
        """Run the largest step (kv_sizing.largest_step) on a throwaway cache and return its
        activation peak (bytes allocated beyond what stays allocated). The throwaway cache stays
        bound to the layers (the graph probe reads it)."""
        dev = self.device
        sched, self.num_blocks = kv_sizing.largest_step(self.config, self.max_model_len)
        self._allocate_kv_cache()
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        self.execute_model(sched)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        self.update_states(SchedulerOutput(finished_req_ids=[r.req_id for r in sched.new_reqs]))
        self.inputs.reset()  # its block ids name blocks of the throwaway cache
        return max(peak, 0)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for layer in self.model.layers():
            attn = layer.self_attn.attn
            self.backend.copy_blocks(attn.k_cache, attn.v_cache, src, dst)

    # ---- one step ---------------------------------------------------------------------------

    def update_states(self, sched: SchedulerOutput) -> None:
        """Bring the runner's copies of the streams to where the scheduler has them."""
        for req_id in sched.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self.inputs.release(state)
        for new in sched.new_reqs:
            self.requests[new.req_id] = CachedRequestState(new)
        for c in sched.cached_reqs:
            state = self.requests[c.req_id]
            state.output_token_ids += c.new_token_ids
            if c.resumed:
                state.block_ids = list(c.new_block_ids)
                state.table_blocks = 0  # its block-table row is stale: rewrite it whole
            else:
                if c.num_kept_blocks is not None and c.num_kept_blocks < len(state.block_ids):
                    del state.block_ids[c.num_kept_blocks:]  # they held rejected drafts only
                    state.table_blocks = min(state.table_blocks, c.num_kept_blocks)
                state.block_ids += c.new_block_ids
            state.num_computed_tokens = c.num_computed_tokens
        for _, child in sched.forks:
            self.requests[child.req_id] = CachedRequestState(child)

    def _prepare_inputs(self, sched: SchedulerOutput) -> StepBatch:
        """Lay the step out as flat rows and stage it in the persistent buffers (host side only:
        nothing reaches the device until _forward uploads it). A step of one token per sequence
        that a captured size holds is padded to that size (its graph replays); any other runs
        eagerly, padded only as the backend asks (padded_num_tokens)."""
        self.inputs.begin_step()
        bs = self.block_size
        ids, positions, slots, seq_lens, rows = [], [], [], [], []
        query_start = [0]
        width = 1
        sample_rows, sample_streams, prompt_rows = [], [], []
        verify_rows, verify_streams = [], []
        pool_chunks, pool_ends = [], []  # embedding requests: rows to sum (mean), rows that finish one
        adapters = {}  # LoRA: the step's adapters by id, and (stream, adapter id, tokens) per sequence
        adapter_runs = []
        children: dict[str, list[CachedRequestState]] = {}
        for parent, child in sched.forks:
            children.setdefault(parent, []).append(self.requests[child.req_id])
        for req_id, n in sched.num_scheduled_tokens:
            state = self.requests[req_id]
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            drafts = sched.draft_token_ids.get(req_id)
            if drafts:
                ids += state.token_ids_slice(start, end - len(drafts)) + drafts
            else:
                ids += state.token_ids_slice(start, end)
            blocks = state.block_ids
            if n == 1:
                positions.append(start)
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                positions += range(start, end)
                for b in range(start // bs, (end - 1) // bs + 1):  # whole runs of slots, block by block
                    base = blocks[b] * bs
                    slots += range(base + max(start - b * bs, 0), base + min(end - b * bs, bs))
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            if state.lora_request is not None:
                adapters[state.lora_request.lora_int_id] = state.lora_request
            adapter_runs.append((req_id, state.lora_request.lora_int_id if state.lora_request is not None else 0, n))
            rows.append(self.inputs.table_row(state))
            width = max(width, len(blocks))
            if state.sampling_params.prompt_logprobs is not None and start < state.num_prompt_tokens - 1:
                # Row p scores prompt token p + 1.
                last = min(end, state.num_prompt_tokens - 1)
                prompt_rows.append((state, start + 1, query_start[-2], query_start[-2] + last - start))
            if state.sampling_params.pooling is not None:
                if state.sampling_params.pooling == "mean":
                    pool_chunks.append((state, start, query_start[-2], query_start[-1]))
                if end == state.num_tokens:
                    pool_ends.append((state, query_start[-1] - 1))
                continue
            if drafts:
                verify_rows += range(query_start[-2], query_start[-1])
                verify_streams.append((state, drafts))
            elif end == state.num_tokens:
                for s in [state, *children.get(req_id, ())]:  # an n > 1 prompt's choices share its row
                    sample_rows.append(query_start[-1] - 1)
                    sample_streams.append(s)
        num_tokens, num_seqs = len(ids), len(seq_lens)
        graph_size = None
        if num_tokens == num_seqs and not prompt_rows and not pool_chunks and not pool_ends and not adapters:
            graph_size = self.graphs.padded_size(max(num_seqs, len(sample_rows)))
        if graph_size is not None:
            padded_tokens = padded_seqs = graph_size
        else:
            # Padding rows (the backend's choice; CPU bounds its matmul shapes) belong to no sequence.
            padded_tokens, padded_seqs = self.backend.padded_num_tokens(num_tokens), num_seqs
        self.inputs.stage(ids, positions, slots, query_start, seq_lens, rows, sample_rows + verify_rows,
                          padded_tokens, padded_seqs)
        broken, step_slots = {}, ()
        if adapters:
            slot_of, unreadable = self.adapters.slots(adapters)
            step_slots = tuple(sorted({slot_of[a] for a in adapters if a in slot_of}))
            slot_of = {**slot_of, 0: -1}
            broken = {r: unreadable[a] for r, a, _ in adapter_runs if a in unreadable}
            self.inputs.stage_lora_slots([slot_of.get(a, -1) for _, a, n in adapter_runs for _ in range(n)],
                                         padded_tokens)
        return StepBatch(num_tokens, padded_tokens, num_seqs, width, sample_streams, verify_streams, prompt_rows,
                         pool_chunks, pool_ends, graph_size, lora_step_slots=step_slots, broken_adapters=broken)

    def _forward(self, step: StepBatch) -> tuple:
        """Queue the step on the device: its inputs (one copy), then the graph replay or the eager
        layers, and the LM head on the rows that sample and on the prompt rows that score prompt
        logprobs. Nothing here waits for the device. Returns (hidden, residual, logits of the
        sample rows then the verify rows, [(stream, first prompt token scored, float32 logits)]);
        hidden and residual are None after a replay (no step that needs them replays)."""
        inputs = self.inputs
        inputs.upload()
        num_samples = len(step.sample_streams) + sum(1 + len(d) for _, d in step.verify_streams)
        if step.graph_size is not None:
            return None, None, self.graphs.run(step.graph_size)[:num_samples], []
        # CPU reads a table as wide as this step's longest sequence; CUDA the full width, whose
        # stride never changes (one Triton specialisation, and the shape a graph reads).
        width = None if self.device.type == "cuda" else step.width
        n, s = step.num_padded_tokens, step.num_seqs
        step.meta = AttentionMetadata(
            slot_mapping=inputs.view("slot_mapping", n),
            block_tables=inputs.block_tables(s, width),
            query_start_loc=inputs.view("query_start_loc", s + 1),
            seq_lens=inputs.view("seq_lens", s),
        )
        step.meta.plan = self.backend.plan_attention(step.meta.block_tables, step.meta.query_start_loc,
                                                     step.meta.seq_lens, self.block_size)
        lora_slots = inputs.view("lora_slots", n) if step.lora_step_slots else None
        with forward_context(step.meta, self.backend, lora_slots, step.lora_step_slots):
            hidden, residual = self.model(inputs.view("input_ids", n), inputs.view("positions", n))
            logits, prompt_logits = None, []
            if self.last_stage:
                # Every TP rank of the last stage computes the logits (the vocabulary is gathered
                # across them); only the sampling rank reads them.
                if num_samples:
                    rows = inputs.view("sample_rows", num_samples)
                    logits = self.model.compute_logits(self.model.final_hidden(hidden[rows], residual[rows]))
                for state, first, a, b in step.prompt_rows:
                    h = self.model.final_hidden(hidden[a:b], residual[a:b])
                    prompt_logits.append((state, first, self.model.compute_logits(h).float()))
        return hidden, residual, logits, prompt_logits

    def _stage_dummy_decode(self, size: int) -> None:
        """Stage a decode batch of `size` padding sequences (what a graph is captured on)."""
        self.inputs.begin_step()
        self.inputs.stage([], [], [], [0], [], [], [], size, size)
        self.inputs.upload()

    def _decode_forward(self, size: int) -> torch.Tensor:
        """The decode step a graph captures for `size` sequences: it reads only the persistent
        buffers (the block table gathered from the rows at its full width) and returns the logits
        of `size` sample rows."""
        inputs = self.inputs
        meta = AttentionMetadata(inputs.slot_mapping[:size], inputs.graph_block_tables(size),
                                 inputs.query_start_loc[:size + 1], inputs.seq_lens[:size])
        meta.plan = self.backend.plan_attention(meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                                self.block_size)
        with forward_context(meta, self.backend):
            hidden, residual = self.model(inputs.input_ids[:size], inputs.positions[:size])
            rows = inputs.sample_rows[:size]
            return self.model.compute_logits(self.model.final_hidden(hidden[rows], residual[rows]))

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        """Apply the step's changes, run its forward, sample; then make the forks' block copies
        (they read blocks this forward wrote). None on a rank that does not sample."""
        if self.threads is not None:
            num_drafts = sum(len(d) for d in sched.draft_token_ids.values())  # a verify step is a decode's size
            self.threads.before_step("prefill" if sched.num_tokens - num_drafts > len(sched.num_scheduled_tokens)
                                     else "decode")
            started = time.perf_counter()
        self.update_states(sched)
        step = self._prepare_inputs(sched)
        hidden, residual, logits, prompt_logits = self._forward(step)
        out = None
        if self.outputs is not None:
            out = ModelRunnerOutput()
            out.failed += [(req_id, "AdapterError", why) for req_id, why in step.broken_adapters.items()]
            for state, first, rows in prompt_logits:
                try:
                    self.outputs.prompt_logprobs(out, state, first, rows)
                except Exception as e:
                    self.outputs.failed(out, state, e)
            num_sampled = len(step.sample_streams)
            if step.sample_streams:
                self.outputs.sample(out, logits[:num_sampled], step.sample_streams)
            if step.verify_streams:
                self.outputs.verify(out, logits[num_sampled:], step.verify_streams)
            if step.pool_chunks or step.pool_ends:
                with forward_context(step.meta, self.backend):  # the final norm runs again
                    self.outputs.pool(out, hidden, residual, step.pool_chunks, step.pool_ends)
        self.copy_blocks(sched.block_copies)
        if self.threads is not None:
            self.threads.after_step(sched.num_tokens, time.perf_counter() - started)
        return out
