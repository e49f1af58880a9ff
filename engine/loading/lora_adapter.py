"""LoRA adapters in PEFT's format: a folder with adapter_config.json and adapter_model.safetensors.

`check_adapter` reads the config and the tensors' names and shapes (not their data) and refuses in
one line what the engine would not compute as PEFT does: DoRA, trained biases, extra trained modules,
targets other than the attention and dense MLP projections, a rank above max_lora_rank, shapes that do
not fit the model. `read_adapter` then loads the matrices. The front end checks each adapter once
(cached by path and modification time); every runner rank loads the ones its steps use.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from dataclasses import dataclass

import torch

# The projections an adapter may target (checkpoint names): attention, and the dense MLP's.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# base_model.model.<module>.lora_A[.<adapter name>].weight
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<kind>[AB])(?:\.[^.]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter the engine cannot serve as PEFT computes it; the message says what and why."""


@dataclass(frozen=True)
class AdapterInfo:
    """What check_adapter found: the rank, the scaling PEFT multiplies B A x by, the targets."""

    rank: int
    scaling: float
    targets: tuple[str, ...]
    base_model: str | None


@dataclass
class LoRAAdapter:
    """An adapter's matrices by module: "model.layers.3.self_attn.q_proj" -> (A [r, in], B [out, r])."""

    info: AdapterInfo
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def target_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """(in features, out features) of each projection an adapter may target on this model; a
    mixture-of-experts model's MLP projections are its experts', which adapters may not target."""
    get = hf_config.get if isinstance(hf_config, dict) else lambda k, d=None: getattr(hf_config, k, d)
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    head_dim = get("head_dim") or hidden // heads
    q, kv = heads * head_dim, (get("num_key_value_heads") or heads) * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden)}
    if not (get("num_local_experts") or get("num_experts")):
        inter = get("intermediate_size")
        shapes.update(gate_proj=(hidden, inter), up_proj=(hidden, inter), down_proj=(inter, hidden))
    return shapes


def _refuse(path: str, what: str) -> AdapterError:
    return AdapterError(f"LoRA adapter {path!r}: {what}")


def _read_config(path: str) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise _refuse(path, f"no {CONFIG_FILE} there: pass a PEFT adapter folder (adapter_config.json + "
                            f"{WEIGHTS_FILE})")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise _refuse(path, f"{CONFIG_FILE} is not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise _refuse(path, f"{CONFIG_FILE} is not a JSON object")
    return config


def _check_config(path: str, config: dict) -> tuple[int, float]:
    """The rank and PEFT's scaling (alpha / r, or alpha / sqrt(r) with rsLoRA); what changes the
    computation beyond B A x is refused."""
    if config.get("peft_type", "LORA") != "LORA":
        raise _refuse(path, f"peft_type {config.get('peft_type')!r} is not LORA")
    refused = [
        (config.get("use_dora"), "DoRA (use_dora) is not supported: merge it into the base weights or retrain as LoRA"),
        (config.get("bias", "none") != "none" or config.get("lora_bias"),
         "trained biases (bias / lora_bias) are not supported: train with bias='none'"),
        (config.get("modules_to_save"), f"modules_to_save {config.get('modules_to_save')!r} (fully trained modules "
                                        "beside the adapter) are not supported"),
        (config.get("rank_pattern") or config.get("alpha_pattern"),
         "per-module ranks or alphas (rank_pattern / alpha_pattern) are not supported"),
        (config.get("target_parameters"), "target_parameters (adapters on expert weights) are not supported"),
        (config.get("fan_in_fan_out"), "fan_in_fan_out (Conv1D-style weights) is not supported"),
    ]
    for asks, why in refused:
        if asks:
            raise _refuse(path, why)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _refuse(path, f"r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise _refuse(path, f"lora_alpha must be a number, got {alpha!r}")
    return rank, (alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank)


def _tensor_shapes(path: str) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        bin_file = os.path.join(path, "adapter_model.bin")
        hint = " (only a pickled adapter_model.bin is there: save it with safe_serialization=True)" if os.path.isfile(
            bin_file) else ""
        raise _refuse(path, f"no {WEIGHTS_FILE} there{hint}")
    try:
        with safe_open(file, "pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as e:  # a truncated or foreign file: say so, in one line
        raise _refuse(path, f"{WEIGHTS_FILE} is not a readable safetensors file ({type(e).__name__}: {e})") from None


def check_adapter(path: str, shapes: dict[str, tuple[int, int]], max_rank: int) -> AdapterInfo:
    """What the adapter at `path` is, or AdapterError saying why a model with these target shapes
    (target_shapes) cannot serve it. Remembered per folder version: requests name adapters again and again."""
    path = os.path.expanduser(str(path))
    if not os.path.isdir(path):
        raise _refuse(path, "no such folder: pass a PEFT adapter folder (adapter_config.json + "
                            f"{WEIGHTS_FILE})")
    version = tuple(_mtime(os.path.join(path, f)) for f in (CONFIG_FILE, WEIGHTS_FILE))
    key = (path, version, tuple(sorted(shapes.items())), max_rank)
    with _checked_lock:  # the server checks from its event loop and from worker threads
        info = _checked.get(key)
    if info is None:
        info = _check(path, shapes, max_rank)
        with _checked_lock:
            if len(_checked) >= _CHECKED_MAX:
                _checked.pop(next(iter(_checked)))
            _checked[key] = info
    return info


_checked: dict[tuple, AdapterInfo] = {}
_checked_lock = threading.Lock()
_CHECKED_MAX = 1024


def _mtime(file: str) -> int | None:
    try:
        return os.stat(file).st_mtime_ns
    except OSError:
        return None


def _check(path: str, shapes: dict[str, tuple[int, int]], max_rank: int) -> AdapterInfo:
    config = _read_config(path)
    rank, scaling = _check_config(path, config)
    if rank > max_rank:
        raise _refuse(path, f"rank {rank} exceeds max_lora_rank {max_rank}: start the engine with "
                            f"--max-lora-rank {rank} or more")
    targets = set()
    pairs: dict[str, set[str]] = {}
    for name, shape in _tensor_shapes(path).items():
        m = _TENSOR.match(name)
        if m is None:
            raise _refuse(path, f"tensor {name!r} is not a LoRA A or B matrix of a linear layer (embedding and "
                                "other adapters are not supported)")
        module, kind = m.group("module"), m.group("kind")
        target = module.rpartition(".")[2]
        if target not in shapes or ".experts." in module or "shared_expert" in module or ".layers." not in module:
            served = ", ".join(shapes)
            raise _refuse(path, f"module {module!r} is not a target this model serves adapters on ({served})")
        in_features, out_features = shapes[target]
        want = (rank, in_features) if kind == "A" else (out_features, rank)
        if shape != want:
            raise _refuse(path, f"{name} has shape {list(shape)}, but this model's {target} needs {list(want)} "
                                f"(rank {rank}): was it trained on another base model?")
        targets.add(target)
        pairs.setdefault(module, set()).add(kind)
    unpaired = sorted(m for m, kinds in pairs.items() if kinds != {"A", "B"})
    if unpaired:
        raise _refuse(path, f"module {unpaired[0]!r} has only one of its lora_A / lora_B matrices")
    if not pairs:
        raise _refuse(path, "it holds no LoRA matrices")
    return AdapterInfo(rank, scaling, tuple(sorted(targets)), config.get("base_model_name_or_path"))


def read_adapter(path: str, info: AdapterInfo, dtype: torch.dtype) -> LoRAAdapter:
    """The matrices of an adapter check_adapter passed, in `dtype`, on the CPU."""
    from safetensors.torch import load_file

    path = os.path.expanduser(str(path))
    tensors = load_file(os.path.join(path, WEIGHTS_FILE))
    found: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        m = _TENSOR.match(name)
        found.setdefault(m.group("module"), {})[m.group("kind")] = tensor.to(dtype)
    return LoRAAdapter(info, {module: (ab["A"], ab["B"]) for module, ab in found.items()})
