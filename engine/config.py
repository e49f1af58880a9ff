"""EngineConfig: every engine knob in one dataclass, validated once at the edge."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

GiB = 1 << 30

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")


@dataclass
class EngineConfig:
    model: str | None = None  # folder, .gguf file, or None for the embedded default model
    tokenizer: str | None = None  # defaults to the model's own
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    kv_cache_dtype: str = "auto"  # auto: same as dtype
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    block_size: int = 16
    # KV cache size: on CPU a fixed budget; on CUDA a fraction of the device minus the
    # profiled peak of a forward pass. num_gpu_blocks overrides both (tests, debugging).
    kv_cache_memory: int = 2 * GiB
    gpu_memory_utilization: float = 0.90
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    num_threads: int | None = None  # torch intra-op threads on CPU; None leaves torch's default
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    max_waiting_requests: int | None = None  # AsyncEngine admission bound; None = unbounded
    log_requests: bool = False  # prompts and outputs stay out of the logs unless asked

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        check(self.dtype in DTYPES, "dtype", f"one of {DTYPES}")
        check(self.kv_cache_dtype in DTYPES, "kv_cache_dtype", f"one of {DTYPES}")
        check(self.device in DEVICES, "device", f"one of {DEVICES}")
        check(self.attention_backend in ATTENTION_BACKENDS, "attention_backend", f"one of {ATTENTION_BACKENDS}")
        check(self.block_size in (8, 16, 32, 64, 128), "block_size", "one of 8, 16, 32, 64, 128")
        check(self.kv_cache_memory > 0, "kv_cache_memory", "positive (bytes)")
        check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "in (0, 1]")
        check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", "None or >= 1")
        check(self.max_num_seqs >= 1, "max_num_seqs", ">= 1")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1")
        check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "None or >= 1")
        check(self.num_threads is None or self.num_threads >= 1, "num_threads", "None or >= 1")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            check(getattr(self, name) >= 1, name, ">= 1")
        check(self.max_waiting_requests is None or self.max_waiting_requests >= 0,
              "max_waiting_requests", "None or >= 0")
        if self.model is not None:
            self.model = os.path.expanduser(str(self.model))
            if not os.path.exists(self.model):
                raise ValueError(
                    f"model path {self.model!r} does not exist: pass a folder with config.json and "
                    "*.safetensors, a .gguf file, or no model for the embedded default"
                )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
