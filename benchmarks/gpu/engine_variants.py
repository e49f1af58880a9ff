"""What the GPU probes (host_profile.py, kernel_profile.py) share: the engine a configuration
name stands for, and module constants set before a run (a sweep's choice, a heuristic to try).

    bf16            the checkpoint's weights
    int4, int8      --quantization int4 / int8 (the layers; embeddings and LM head stay bf16)
    int4+head       the same with --quantize-lm-head (the vocabulary matrices quantized too)
"""

from __future__ import annotations

import importlib
import json


def engine_kwargs(kind: str | None) -> dict:
    """EngineConfig fields for a configuration name (None or "bf16": none)."""
    if kind in (None, "bf16"):
        return {}
    method, _, extra = kind.partition("+")
    if extra not in ("", "head"):
        raise ValueError(f"configuration {kind!r}: a method, optionally +head")
    return {"quantization": method, **({"quantize_lm_head": True} if extra == "head" else {})}


def set_constant(module_name: str, name: str, value) -> None:
    module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise ValueError(f"{module_name} has no {name}")
    setattr(module, name, tuple(value) if isinstance(value, list) else value)


def apply_tiles(path: str) -> None:
    """Set kernels.triton_quant_packed's constants from a packed_bench.py --best-json file."""
    with open(path) as f:
        for name, value in json.load(f).items():
            set_constant("kernels.triton_quant_packed", name, value)
    print(f"packed tiles: {path}", flush=True)


def apply_settings(items: list[str]) -> None:
    """--set module.NAME=JSON, e.g. kernels.triton_heuristics.MIN_KEYS_PER_SPLIT=128."""
    for item in items:
        target, _, value = item.partition("=")
        module_name, _, name = target.rpartition(".")
        set_constant(module_name, name, json.loads(value))
        print(f"set {target} = {value}", flush=True)


def add_arguments(p) -> None:
    p.add_argument("--packed-tiles", help="JSON of kernels.triton_quant_packed constants to set first "
                                          "(packed_bench.py --best-json: its sweep's choice)")
    p.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=JSON",
                   help="a module constant to set first (repeatable)")


def apply_arguments(args) -> None:
    if args.packed_tiles:
        apply_tiles(args.packed_tiles)
    apply_settings(args.set)
