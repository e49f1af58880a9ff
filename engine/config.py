"""EngineConfig: every engine knob in one dataclass, validated once at the edge.

Each field's help text lives next to it (`metadata["help"]`): engine/arg_utils.py turns the
fields into the command-line flags of `engine serve | generate | bench` (and `engine plan`
where a setting means something there), so a knob has one name and one description everywhere.
This module imports nothing heavy: `engine plan` shares its vocabulary and must start instantly.
"""

from __future__ import annotations

import logging
import json
import math
import os
import re
from dataclasses import dataclass, field, fields, replace

logger = logging.getLogger(__name__)

GiB = 1 << 30
CPU_KV_CACHE_MEMORY = 2 * GiB  # the KV budget on CPU when kv_cache_memory is not given
SIZE_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "kb": 10**3, "mib": 1 << 20, "mb": 10**6, "gib": 1 << 30, "gb": 10**9,
              "tib": 1 << 40, "tb": 10**12}


def parse_size(text) -> int:
    """Bytes from an int or a text with an optional unit ("512MiB", "4GB", "1e6" is not one):
    kv_cache_memory at the API and its flag alike; ValueError saying what a size looks like."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size: use bytes or a unit such as 4GiB or 512MiB")
    return int(float(m.group(1)) * SIZE_UNITS[m.group(2).lower()])

DTYPES = ("auto", "float32", "bfloat16", "float16")
BLOCK_SIZES = (8, 16, 32, 64, 128)  # tokens a KV block holds (the kernels' tiles divide them)
GGUF_WEIGHTS = ("native", "dequantize")
GGUF_ACTIVATIONS = ("int16", "int8", "float")
# --quantization: int8 / int4 / fp8 quantize a float checkpoint at load (engine/quant/quantize.py);
# the others are vLLM's method names for pre-quantized checkpoints (engine/quant/prequantized.py).
AT_LOAD_QUANTIZATIONS = ("int8", "int4", "fp8")
QUANTIZATIONS = (*AT_LOAD_QUANTIZATIONS, "gptq", "awq", "compressed-tensors")
QUANTIZATION_GROUP_SIZES = (32, 128)
# The spellings vLLM, PyTorch and Hugging Face users type for the same three dtypes.
# vLLM's "fp8" KV cache is e4m3; it also takes the explicit name.
DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32", "fp32": "float32",
                 "fp8_e4m3": "fp8"}
KV_CACHE_DTYPES = (*DTYPES, "fp8")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")

# speculative_config: the ngram method's keys (vLLM's), the draft-model methods vLLM has and this
# engine refuses, and the most draft tokens a step verifies per sequence.
SPECULATIVE_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
DRAFT_METHODS = ("draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix")
MAX_SPECULATIVE_TOKENS = 15


# Environment variables that were engine knobs before they became fields here. They are no longer
# read; if one is still set, the config warns once which flag replaces it.
REMOVED_ENV_KNOBS = {
    "PAGEWISE_PP_MICRO_BATCHES": "pipeline_micro_batches",
    "PAGEWISE_PP_LAYER_PARTITION": "pipeline_layer_partition",
    "PAGEWISE_DIST_TIMEOUT_S": "distributed_timeout_s",
}
_warned_env: set[str] = set()


def _warn_removed_env() -> None:
    for name, knob in REMOVED_ENV_KNOBS.items():
        if name in os.environ and name not in _warned_env:
            _warned_env.add(name)
            logger.warning("%s is no longer read: use --%s (EngineConfig.%s) instead", name,
                           knob.replace("_", "-"), knob)


# A Hugging Face Hub model id as huggingface_hub spells one, ORG/NAME (each part starts and ends
# with a letter, digit or underscore), with :FILE.gguf naming one GGUF file of the repository.
_HUB_PART = r"[A-Za-z0-9_](?:[\w.-]{0,94}[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"({_HUB_PART}/{_HUB_PART})(?::([^:]+\.gguf))?")
GENERATION_CONFIGS = ("auto", "vllm")

# vLLM's flags that are accepted and change nothing here, and what they would have done: one notice each.
VLLM_NOTICES = {
    "trust_remote_code": "--trust-remote-code: no checkpoint code is ever run here: the model families are "
                         "implemented in the engine and tokenizers load without remote code (a model whose "
                         "config.json maps its model class to its own code is refused)",
    "disable_log_requests": "--disable-log-requests has no effect: requests are logged only with --log-requests",
    "disable_log_stats": "--disable-log-stats has no effect: there is no periodic stats line (/metrics has the "
                         "numbers)",
    "swap_space": "--swap-space has no effect: a preempted request's KV blocks are freed and its tokens recomputed "
                  "when it resumes, never swapped to CPU memory",
}
_noticed: set[str] = set()


def hub_id(text) -> tuple[str, str | None] | None:
    """(ORG/NAME, FILE.gguf or None) when `text` is a Hub model id, None when it is not one (a path
    such as ./x, /x, ~/x or a/b/c). Whether a local path of that name exists is the caller's question:
    a local path always wins."""
    m = _HUB_ID.fullmatch(str(text))
    if m is None or "--" in m.group(1) or ".." in m.group(1):  # huggingface_hub refuses both in an id
        return None
    return m.group(1), m.group(2)


def canonical_dtype(name: str) -> str:
    """`half` -> `float16`, `bf16` -> `bfloat16`, ...; any other name is returned as given."""
    return DTYPE_ALIASES.get(str(name).lower(), name)


def _knob(default, help: str):
    return field(default=default, metadata={"help": help})


# What a CPU serving step's prefill is held to unless the config says (EngineConfig.for_serving).
SERVING_CPU_MAX_PREFILL_TOKENS = 256
SERVING_CPU_MAX_PREFILL_ATTENTION = 131072

@dataclass
class EngineConfig:
    model: str | None = _knob(None, "a Hugging Face model folder (config.json + *.safetensors), a .gguf file, or "
                                    "a Hub id ORG/NAME (ORG/NAME:FILE.gguf for one GGUF file of it), read from the "
                                    "Hugging Face cache or downloaded into it; a local path of that name wins "
                                    "(default: the embedded SmolLM2-135M-Instruct)")
    tokenizer: str | None = _knob(None, "tokenizer folder or Hub id ORG/NAME (default: the model's own)")
    revision: str | None = _knob(None, "a Hub id's branch, tag or commit, for --model and a --tokenizer of the "
                                       "same repository (default: main)")
    download_dir: str | None = _knob(None, "the Hugging Face cache folder Hub ids are read from and downloaded "
                                           "into (default: $HF_HUB_CACHE, else $HF_HOME/hub, else "
                                           "~/.cache/huggingface/hub)")
    gguf_file: str | None = _knob(None, "the .gguf file of a Hub id --model to serve, the same as --model "
                                        "ORG/NAME:FILE.gguf (default: the repository's safetensors)")
    generation_config: str = _knob("auto", "sampling defaults for the requests that do not set them: auto (the "
                                           "model's generation_config.json: temperature, top_p, top_k, min_p, "
                                           "repetition_penalty, and max_new_tokens as max_tokens), vllm (none: "
                                           "the API's own defaults), or a folder holding a generation_config.json "
                                           "(default: auto)")
    trust_remote_code: bool = _knob(False, "vLLM's flag, accepted with a notice: no checkpoint code is ever run "
                                           "(the model families are the engine's own; tokenizers load without "
                                           "remote code), and a model whose config.json maps its model class to "
                                           "its own code (auto_map) is refused")
    disable_log_requests: bool = _knob(False, "vLLM's flag, accepted with a notice: requests are logged only with "
                                              "--log-requests")
    disable_log_stats: bool = _knob(False, "vLLM's flag, accepted with a notice: there is no periodic stats line "
                                           "(/metrics has the numbers)")
    swap_space: float | None = _knob(None, "vLLM's flag (GiB of CPU swap per GPU; default: unset), accepted with "
                                           "a notice: a preempted request's KV blocks are freed and its tokens "
                                           "recomputed, never swapped")
    chat_template: str | None = _knob(None, "chat template replacing the tokenizer's own: a file, or the Jinja "
                                            "text itself (default: the tokenizer's template)")
    gguf_weights: str = _knob("native", "a .gguf file's quantized linear weights: native (kept as the file's "
                                        "Q8_0 / Q4_0 / Q4_1 blocks, C++ kernels on CPU) or dequantize (to float "
                                        "at load, as before)")
    quantization: str | None = _knob(None, "weight-only quantization: int8 (per-channel symmetric) or int4 "
                                           "(asymmetric, groups of --quantization-group-size inputs) applied at load "
                                           "to a float checkpoint, kept as GGUF Q8_0 / Q4_1 blocks; fp8 (e4m3, "
                                           "a float32 scale per tensor, vLLM's; triton and torch backends); gptq, awq, "
                                           "compressed-tensors: read a pre-quantized checkpoint as that method "
                                           "(detected from config.json without the flag) (default: none)")
    quantization_group_size: int = _knob(128, "--quantization int4: input channels sharing one scale and min, "
                                              "32 or 128")
    quantize_lm_head: bool = _knob(False, "--quantization int8 / int4 / fp8: quantize the LM head too, and with tied "
                                          "embeddings the shared embedding matrix (the lookup dequantizes its rows): "
                                          "8-bit Q8_0 under int8 and int4, as llama.cpp's Q4 files keep it, fp8 "
                                          "under fp8; the head is up to half of a small model's quantized "
                                          "decode-step bytes; off: both stay at --dtype, as in vLLM")
    dtype: str = _knob("auto", "weights and activations; half/fp16 = float16, bf16 = bfloat16, "
                               "float/fp32 = float32; auto: bfloat16 on CUDA; on CPU bfloat16 for a 16-bit or "
                               "quantized checkpoint where the CPU multiplies bf16 natively (AVX512_BF16, AMX), "
                               "else float32")
    kv_cache_dtype: str = _knob("auto", "KV cache elements, same names as --dtype, or fp8 (= fp8_e4m3, vLLM's "
                                        "names: 1 byte, per-tensor scales 1.0); auto: the same as --dtype")
    device: str = _knob("auto", "auto: cuda when torch sees a GPU, else cpu")
    seed: int = _knob(0, "seed of the sampler's random generator: the same seed and prompts give the same "
                         "output; a request's own seed (the API's `seed`) overrides it for that request")
    max_model_len: int | None = _knob(None, "context window in tokens, prompt and output together (default: the "
                                            "model's max_position_embeddings, lowered to what the KV cache holds)")
    block_size: int = _knob(16, "tokens per KV cache block")
    # KV cache size: kv_cache_memory if given (any device); else on CPU a fixed budget, on CUDA what
    # gpu_memory_utilization leaves after weights, the profiled peak and the CUDA graphs (vLLM's
    # rule). num_kv_blocks overrides them all (tests, debugging).
    kv_cache_memory: int | str | None = _knob(None, "KV cache budget on any device, in bytes or with a unit "
                                                    "(512MiB, 4GiB, 4GB) (default: 2GiB on CPU; on CUDA what "
                                                    "--gpu-memory-utilization leaves)")
    gpu_memory_utilization: float = _knob(0.90, "CUDA: the fraction of the GPU's memory the engine may use "
                                                "(weights, activations, CUDA graphs and KV cache)")
    enforce_eager: bool = _knob(False, "CUDA: run every step eagerly, capturing no CUDA graphs (vLLM's flag); on "
                                       "CPU, which never captures, accepted and a no-op")
    cuda_graph_sizes: list[int] | None = _knob(None, "CUDA: decode batch sizes to capture graphs for (vLLM's flag): "
                                                     "one value N means 1, 2, 4, 8, then every 8 up to N; several "
                                                     "are the sizes themselves; clipped to --max-num-seqs (default: "
                                                     "up to --max-num-seqs)")
    num_kv_blocks: int | None = _knob(None, "a fixed number of KV cache blocks, overriding both budgets "
                                            "(default: sized from the budget)")
    max_num_seqs: int = _knob(256, "most sequences running at once (one batch)")
    max_num_batched_tokens: int = _knob(2048, "token budget of one engine step: prefill and decode tokens "
                                              "of one forward pass")
    enable_chunked_prefill: bool = _knob(True, "split a long prompt's prefill over several steps")
    # On CPU a step lasts as long as its prompt tokens and the earlier tokens each one attends to,
    # and an abort or a new request waits for the step under way: these keep a serving step short.
    # Offline nothing arrives or aborts mid-run, so there (None) whole budgets prefill at once.
    cpu_max_prefill_tokens: int | None = _knob(None, "cpu, with chunked prefill: prompt tokens one step computes "
                                                     "at most (within --max-num-batched-tokens), so that a step, "
                                                     "which an abort or a new request waits for, stays well under "
                                                     f"a second; default: {SERVING_CPU_MAX_PREFILL_TOKENS} when "
                                                     "serving, no limit offline")
    cpu_max_prefill_attention: int | None = _knob(None, "cpu, with chunked prefill: (prompt token, earlier token) "
                                                        "pairs one step's prefill attends over at most, so that a "
                                                        "chunk deep into a long prompt is smaller and its step as "
                                                        f"short; default: {SERVING_CPU_MAX_PREFILL_ATTENTION} when "
                                                        "serving, no limit offline")
    enable_prefix_caching: bool = _knob(True, "share the KV blocks of a prompt prefix already computed")
    attention_backend: str = _knob("auto", "kernels: triton (CUDA), cpu (C++), torch (the reference); "
                                           "auto picks by device")
    cpu_fused_layers: bool = _knob(True, "cpu backend: run a small step (up to 16 tokens) through the decoder "
                                   "layers in one C++ call, which computes what the modules do (dense "
                                   "Llama-family layers, one process); off: the modules op by op")
    cpu_gguf_activations: str = _knob("int16", "cpu backend, a .gguf file's Q4_0 / Q4_1 / Q8_0 matmuls at steps "
                                      "of up to 16 tokens: int16 (activations scaled to int16 per 32-block, "
                                      "integer dot products, relative error ~2e-5; AVX2 builds), int8 "
                                      "(llama.cpp's scheme: faster on Q4, perplexity +0.5-1 percent), or float (the "
                                      "dequantized weights' numbers to summation order)")
    cpu_bf16_weights: bool = _knob(True, "cpu backend, float32 model, or bfloat16 on a CPU without AMX: a "
                                         "checkpoint's bfloat16 matrices (safetensors or a BF16 .gguf) stay as stored, "
                                         "half of float32's bytes, for the C++ matmul kernels: a float32 model widens "
                                         "them in registers (the same values; sums in another order), a bfloat16 one "
                                         "takes bf16 dot products up to 64 rows (AVX512_BF16) and oneDNN's GEMM on "
                                         "them as stored beyond; off: converted to float32, or (bfloat16) packed for "
                                         "oneDNN's matmul at load (batched within 2 percent, slower at one sequence)")
    num_threads: int | None = _knob(None, "CPU: torch intra-op threads, fixed (default: the CPUs this process may "
                                          "use, its affinity capped by its cgroup CPU quota; fewer while other "
                                          "processes keep them busy and fewer measure faster; bound one to each CPU "
                                          "while other processes fill every one)")
    tensor_parallel_size: int = _knob(1, "split each layer over this many GPUs (CPU: processes)")
    pipeline_parallel_size: int = _knob(1, "split the layers into this many stages, one per GPU group")
    data_parallel_size: int = _knob(1, "independent engine replicas behind one server")
    core_process: bool = _knob(False, "run the engine core (scheduler, model steps) in a process of its own, "
                                      "as vLLM's V1 does: the front end's process keeps HTTP, tokenization and "
                                      "detokenization, so they never share the interpreter with the steps (always "
                                      "so with data_parallel_size > 1)")
    enable_expert_parallel: bool = _knob(False, "mixture-of-experts: the tensor-parallel ranks hold whole "
                                                "experts each instead of a slice of every expert")
    pipeline_micro_batches: int | None = _knob(None, "micro-batches per engine step with pipeline stages, so "
                                                     "that the stages work at once; 1 turns the overlap off "
                                                     "(default: one per pipeline stage)")
    pipeline_layer_partition: str | None = _knob(None, "layers per pipeline stage, comma-separated, e.g. 3,1 "
                                                       "(a stage that also holds the embeddings or the LM head "
                                                       "may deserve fewer; default: the balanced split)")
    distributed_timeout_s: float = _knob(60.0, "tensor/pipeline parallel: seconds a wait on another rank inside "
                                               "a step may last before a hung rank becomes an error")
    # Admission: sequences (prompts x n) that may wait for a slot beyond the max_num_seqs running
    # ones; past it a request gets a 503 (and one that could never fit, a 400). None = unbounded.
    max_waiting_requests: int | None = _knob(1024, "sequences (prompts x n) that may wait beyond the "
                                                   "--max-num-seqs running ones; past it a request gets "
                                                   "503; none: unbounded")
    max_logprobs: int = _knob(20, "the largest logprobs / top_logprobs / prompt_logprobs a request may ask for")
    log_requests: bool = _knob(False, "log each request's prompt and output (off: they stay out of the logs)")
    # Structured output: what a request's grammar may cost (engine/structured_output/).
    grammar_max_bytes: int = _knob(65536, "structured output: the largest JSON schema, regex, grammar or choice "
                                          "list (its JSON text, in bytes) a request may send; larger is a 400")
    grammar_max_depth: int = _knob(64, "structured output: how deep a JSON schema's text may nest (objects and "
                                       "arrays); deeper is a 400")
    grammar_max_values: int = _knob(2048, "structured output: the most enum/const values a JSON schema may list, "
                                          "or choices a choice list; more is a 400")
    grammar_compile_timeout_s: float = _knob(10.0, "structured output: seconds a grammar may take to compile; "
                                                   "past it the request is a 400 (too complex)")
    grammar_cache_mib: int = _knob(32, "structured output: memory for compiled grammars (MiB), least recently "
                                       "used dropped first")
    json_value_limits: bool = _knob(True, "structured output: JSON integers, numbers and strings that the schema "
                                          "leaves unbounded get bounds that let the output close (64-bit integers, "
                                          "doubles, strings of at most about max_tokens / 2 characters)")

    speculative_config: dict | None = _knob(None, "speculative decoding, vLLM's JSON: {\"method\": \"ngram\", "
                                                  "\"num_speculative_tokens\": K, \"prompt_lookup_max\": N, "
                                                  "\"prompt_lookup_min\": M}: requests decode up to K tokens a "
                                                  "step that continue an earlier occurrence of their last M..N "
                                                  "tokens, verified by the model: greedy ones token for token, "
                                                  "sampled ones from the same distribution (default: off)")

    enable_lora: bool = _knob(False, "serve LoRA adapters (PEFT folders) beside the base model: requests name one "
                                     "(vLLM's flag); off: no adapter weights are allocated")
    max_loras: int = _knob(1, "LoRA: adapters one step may run at once (their weights stay in that many slots "
                              "next to the model)")
    max_lora_rank: int = _knob(16, "LoRA: the largest adapter rank served (each slot holds this rank)")
    max_cpu_loras: int | None = _knob(None, "LoRA: adapters kept loaded in CPU memory, least recently used "
                                            "dropped first (default: max_loras)")

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        self._check_types()
        check(-(1 << 63) <= self.seed < 1 << 64, "seed", "a 64-bit integer (what torch's generators take)")
        self.dtype = canonical_dtype(self.dtype)
        self.kv_cache_dtype = canonical_dtype(self.kv_cache_dtype)
        check(self.dtype in DTYPES, "dtype", f"one of {DTYPES}")
        check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", f"one of {KV_CACHE_DTYPES}")
        check(self.device in DEVICES, "device", f"one of {DEVICES}")
        check(self.gguf_weights in GGUF_WEIGHTS, "gguf_weights", f"one of {GGUF_WEIGHTS}")
        check(self.cpu_gguf_activations in GGUF_ACTIVATIONS, "cpu_gguf_activations", f"one of {GGUF_ACTIVATIONS}")
        check(self.quantization is None or self.quantization in QUANTIZATIONS, "quantization",
              f"None or one of {QUANTIZATIONS}")
        check(self.quantization_group_size in QUANTIZATION_GROUP_SIZES, "quantization_group_size",
              f"one of {QUANTIZATION_GROUP_SIZES}")
        check(self.quantization_group_size == 128 or self.quantization == "int4", "quantization_group_size",
              "left at 128 unless quantization is 'int4' (only int4 quantizes in groups here)")
        check(not self.quantize_lm_head or self.quantization in AT_LOAD_QUANTIZATIONS, "quantize_lm_head",
              f"False unless quantization is one of {AT_LOAD_QUANTIZATIONS}, which quantize a float checkpoint at "
              "load (a GGUF file's head is served as stored, a pre-quantized checkpoint's as its config says): add "
              "--quantization int4 (or int8, fp8), or drop --quantize-lm-head")
        check(self.attention_backend in ATTENTION_BACKENDS, "attention_backend", f"one of {ATTENTION_BACKENDS}")
        check(self.block_size in BLOCK_SIZES, "block_size", f"one of {', '.join(map(str, BLOCK_SIZES))}")
        if self.kv_cache_memory is not None:
            try:
                self.kv_cache_memory = parse_size(self.kv_cache_memory)
            except ValueError as e:
                raise ValueError(f"kv_cache_memory: {e}") from None
        check(self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory", "None or positive (bytes)")
        if self.cuda_graph_sizes is not None:
            sizes = [self.cuda_graph_sizes] if isinstance(self.cuda_graph_sizes, int) else self.cuda_graph_sizes
            check(len(sizes) > 0 and all(isinstance(n, int) and n >= 1 for n in sizes), "cuda_graph_sizes",
                  "None or batch sizes >= 1")
            self.cuda_graph_sizes = list(sizes)
        check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "in (0, 1]")
        check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", "None or >= 1")
        check(self.max_num_seqs >= 1, "max_num_seqs", ">= 1")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1")
        check(self.cpu_max_prefill_tokens is None or self.cpu_max_prefill_tokens >= 1, "cpu_max_prefill_tokens",
              "None or >= 1")
        check(self.cpu_max_prefill_attention is None or self.cpu_max_prefill_attention >= 1,
              "cpu_max_prefill_attention", "None or >= 1")
        check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "None or >= 1")
        check(self.num_threads is None or self.num_threads >= 1, "num_threads", "None or >= 1")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            check(getattr(self, name) >= 1, name, ">= 1")
        check(self.pipeline_micro_batches is None or self.pipeline_micro_batches >= 1,
              "pipeline_micro_batches", "None or >= 1")
        check(self.distributed_timeout_s > 0, "distributed_timeout_s", "positive (seconds)")
        if self.pipeline_layer_partition is not None:
            self._check_layer_partition()
        check(self.max_waiting_requests is None or self.max_waiting_requests >= 0,
              "max_waiting_requests", "None or >= 0")
        check(self.max_logprobs >= 0, "max_logprobs", ">= 0")
        if self.model is not None:
            self.model = os.path.expanduser(str(self.model))
            if not os.path.exists(self.model) and hub_id(self.model) is None:
                raise ValueError(
                    f"model path {self.model!r} does not exist: pass a folder with config.json and "
                    "*.safetensors, a .gguf file, a Hub id ORG/NAME, or no model for the embedded default"
                )
        if self.tokenizer is not None:
            self.tokenizer = os.path.expanduser(str(self.tokenizer))
            if not os.path.exists(self.tokenizer) and hub_id(self.tokenizer) is None:
                raise ValueError(f"tokenizer path {self.tokenizer!r} does not exist: pass a folder with the "
                                 "tokenizer's files (tokenizer.json or tokenizer_config.json), a Hub id "
                                 "ORG/NAME, or leave it unset for the model's own")
        self._check_hub_settings()
        check(self.swap_space is None or self.swap_space >= 0, "swap_space", "None or >= 0 (GiB)")
        check(not (self.log_requests and self.disable_log_requests), "disable_log_requests",
              "False with log_requests (the two contradict): drop one")
        if self.chat_template is not None:
            self._check_chat_template()
        if self.speculative_config is not None:
            self._check_speculative_config()
        check(self.max_loras >= 1, "max_loras", ">= 1")
        check(self.max_lora_rank >= 1, "max_lora_rank", ">= 1")
        check(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras, "max_cpu_loras",
              f"None or >= max_loras ({self.max_loras})")
        _warn_removed_env()
        for name, notice in VLLM_NOTICES.items():
            if getattr(self, name) not in (None, False) and name not in _noticed:
                _noticed.add(name)
                logger.warning(notice)

    def model_hub_id(self) -> tuple[str, str | None] | None:
        """(ORG/NAME, FILE.gguf or None) when `model` is a Hub id rather than a local path, else None."""
        if self.model is None or os.path.exists(self.model):
            return None
        repo, gguf = hub_id(self.model)
        return repo, gguf or self.gguf_file

    def _check_hub_settings(self) -> None:
        """revision and gguf_file say which files of a Hub id to read: with a local model they would
        silently do nothing. generation_config is a mode or a folder that exists."""
        hub = self.model_hub_id()
        if self.revision is not None and hub is None:
            model = "the embedded default" if self.model is None else f"the local path {self.model!r}"
            raise ValueError(f"revision {self.revision!r} picks a version of a Hub id --model (ORG/NAME), but the "
                             f"model is {model}: drop --revision")
        if self.gguf_file is not None:
            if hub is None or hub_id(self.model)[1] not in (None, self.gguf_file):
                raise ValueError(f"gguf_file {self.gguf_file!r} names a file of a Hub id --model ORG/NAME, and "
                                 f"--model is {self.model!r}: give --model ORG/NAME, or the .gguf path as --model")
            if not str(self.gguf_file).endswith(".gguf"):
                raise ValueError(f"gguf_file {self.gguf_file!r} must name a .gguf file of the repository")
        if self.download_dir is not None:
            self.download_dir = os.path.expanduser(str(self.download_dir))
        if self.generation_config not in GENERATION_CONFIGS:
            path = os.path.expanduser(str(self.generation_config))
            folder = os.path.dirname(path) if os.path.basename(path) == "generation_config.json" else path
            if not os.path.isfile(os.path.join(folder, "generation_config.json")):
                raise ValueError(f"generation_config {self.generation_config!r} is neither auto, vllm, nor a folder "
                                 "holding a generation_config.json: pass one of those")
            self.generation_config = folder

    def _check_types(self) -> None:
        """Numbers and flags are what their fields say (the CLI's argparse converts; the Python API
        passes values through): an int is no bool or float, a float is finite, a bool is a bool."""
        for f in fields(self):
            kinds = {k.strip() for k in f.type.split("|")}
            value = getattr(self, f.name)
            if not kinds <= {"int", "float", "bool", "None"} or (value is None and "None" in kinds):
                continue  # a text, a list or a size with a unit: checked below
            if "bool" in kinds:
                ok, rule = isinstance(value, bool), "True or False"
            elif "float" in kinds:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                rule = "a finite number"
            else:
                ok, rule = isinstance(value, int) and not isinstance(value, bool), "an integer"
            if not ok:
                raise ValueError(f"{f.name} must be {rule}{' or None' if 'None' in kinds else ''}, got {value!r}")

    @property
    def layer_partition(self) -> tuple[int, ...] | None:
        """pipeline_layer_partition as layer counts, one per stage; None: the balanced split."""
        if self.pipeline_layer_partition is None:
            return None
        return tuple(int(x) for x in self.pipeline_layer_partition.split(","))

    def _check_layer_partition(self) -> None:
        # The counts' sum is checked against the model's layers later (engine.distributed.layout).
        value = self.pipeline_layer_partition
        text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value).replace(" ", "")
        try:
            counts = [int(x) for x in text.split(",")]
        except ValueError:
            counts = []
        pp = self.pipeline_parallel_size
        if len(counts) != pp or min(counts) < 1:
            raise ValueError(f"pipeline_layer_partition must be {pp} positive layer count(s) separated by commas, "
                             f"one per pipeline stage (pipeline_parallel_size {pp}), e.g. 3,1 for two stages; "
                             f"got {value!r}")
        self.pipeline_layer_partition = text

    def _check_chat_template(self) -> None:
        # A template is Jinja text ({{ ... }} / {% ... %}); anything else must be a file that exists,
        # so a mistyped path fails here rather than becoming a template that prints the path.
        text = str(self.chat_template)
        if "{" in text:
            return
        path = os.path.expanduser(text)
        if not os.path.isfile(path):
            raise ValueError(f"chat_template {text!r} is neither a file nor a Jinja template: "
                             "pass a template file's path or the template text")
        self.chat_template = path

    def _check_speculative_config(self) -> None:
        """vLLM's keys and defaults (prompt_lookup_min and _max default to each other, or both to 5);
        what this engine does not speculate with is refused here, in one line."""
        spec = self.speculative_config
        if isinstance(spec, str):  # the flag's JSON text
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON ({e}): pass e.g. "
                                 '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a JSON object (a dict), got {spec!r}")
        spec = dict(spec)
        method = spec.get("method")
        if method is None and spec.get("model") is not None or method in DRAFT_METHODS:
            raise ValueError(f"speculative_config: draft-model speculation ({method or 'model'}) is not supported "
                             "yet: use {\"method\": \"ngram\"} (prompt lookup)")
        if method != "ngram":
            raise ValueError(f"speculative_config method must be 'ngram', got {method!r}")
        unknown = sorted(set(spec) - SPECULATIVE_KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; an ngram config takes "
                             f"{', '.join(sorted(SPECULATIVE_KEYS))}")
        k = spec.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens must be an integer in "
                             f"1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        lo, hi = (lo if lo is not None else hi or 5), (hi if hi is not None else lo or 5)
        for name, n in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {n!r}")
        if lo > hi:
            raise ValueError(f"speculative_config prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) > 1:
                raise ValueError(f"speculative_config is not supported with {name} > 1 yet: drop one of them")
        spec.update(num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi)
        self.speculative_config = spec

    def for_serving(self) -> "EngineConfig":
        """This config as an online engine runs it: the CPU prefill limits it leaves unset filled in,
        since there every step holds up the aborts, arrivals and streams that wait for it."""
        return replace(
            self,
            cpu_max_prefill_tokens=self.cpu_max_prefill_tokens or SERVING_CPU_MAX_PREFILL_TOKENS,
            cpu_max_prefill_attention=self.cpu_max_prefill_attention or SERVING_CPU_MAX_PREFILL_ATTENTION)

    @classmethod
    def help(cls, name: str) -> str:
        """The help text of one field (the flag's, and the docs')."""
        return next(f.metadata.get("help", "") for f in fields(cls) if f.name == name)
