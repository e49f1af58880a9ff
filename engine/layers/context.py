"""The forward context: what every layer of one forward pass reads and none computes, namely the
step's attention metadata and the kernel backend. The model runner sets it around each forward
(`forward_context(...)`), so layers take no batch layout or backend arguments; as in nano-vllm's
utils/context.py. Per thread, so engines stepping in different threads of one process never see
each other's step."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch

import kernels


@dataclass
class AttentionMetadata:
    """This step's batch layout (see kernels/reference.py)."""

    slot_mapping: torch.Tensor  # [num_tokens]
    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    query_start_loc: torch.Tensor  # [num_seqs + 1]
    seq_lens: torch.Tensor  # [num_seqs]
    plan: object | None = None  # backend.plan_attention(...): computed once per step, used by every layer


@dataclass
class ForwardContext:
    attn: AttentionMetadata
    backend: kernels.Backend  # resolved once by the model runner at start-up
    # LoRA: each token's adapter slot (-1: the base model), int32 [tokens]; None when no token of the
    # step runs an adapter (engine/layers/lora.py).
    lora_slots: torch.Tensor | None = None
    lora_step_slots: tuple[int, ...] = ()  # the distinct slots among them


_local = threading.local()


def set_forward_context(attn: AttentionMetadata, backend: kernels.Backend, lora_slots: torch.Tensor | None = None,
                        lora_step_slots: tuple[int, ...] = ()) -> None:
    _local.context = ForwardContext(attn, backend, lora_slots, lora_step_slots)


def get_forward_context() -> ForwardContext:
    context = getattr(_local, "context", None)
    assert context is not None, "no forward context: layers run inside ModelRunner.execute_model"
    return context


def reset_forward_context() -> None:
    _local.context = None


@contextlib.contextmanager
def forward_context(attn: AttentionMetadata, backend: kernels.Backend, lora_slots: torch.Tensor | None = None,
                    lora_step_slots: tuple[int, ...] = ()):
    """set_forward_context for the duration of a `with` block."""
    set_forward_context(attn, backend, lora_slots, lora_step_slots)
    try:
        yield
    finally:
        reset_forward_context()
