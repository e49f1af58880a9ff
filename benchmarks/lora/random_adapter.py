"""A random LoRA adapter in PEFT's format (adapter_config.json + adapter_model.safetensors) for a
model's shapes, to measure what serving adapters costs (the values do not matter, the shapes do).

    python benchmarks/lora/random_adapter.py --output DIR [--model M] [--rank 16] [--targets q_proj,...]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from safetensors.torch import save_file

ALL_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="the adapter folder to write")
    parser.add_argument("--model", default=None, help="the base model (default: the embedded default model)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default=ALL_TARGETS, help="comma-separated projections")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from engine.loading.loader import resolve_model
    from engine.loading.lora_adapter import target_shapes

    hf = resolve_model(args.model).hf_config
    shapes = target_shapes(hf)
    targets = args.targets.split(",")
    torch.manual_seed(args.seed)
    tensors = {}
    for layer in range(hf.num_hidden_layers):
        for target in targets:
            in_features, out_features = shapes[target]
            group = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{group}.{target}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(args.rank, in_features) / in_features ** 0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(out_features, args.rank) / args.rank ** 0.5
    os.makedirs(args.output, exist_ok=True)
    save_file(tensors, os.path.join(args.output, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": args.rank, "lora_alpha": 2 * args.rank, "target_modules": targets,
              "bias": "none", "base_model_name_or_path": args.model}
    with open(os.path.join(args.output, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    print(args.output)


if __name__ == "__main__":
    main()
