"""Random-weight Llama (and Mixtral) checkpoints of a chosen size, for throughput benchmarks.

Speed does not depend on the weights' values, so a random model of the right shape
measures a size no small real model covers. The tokenizer is a real one (by default the
embedded SmolLM2's, 49,152 tokens), so every id the model emits decodes.

    python -m engine.bench.random_model /tmp/llama-350m               # ~0.35B, bfloat16
    python -m engine.bench.random_model OUT --preset llama-1b --tokenizer PATH
    python -m engine.bench.random_model /tmp/mixtral-tiny --preset mixtral-tiny  # 8 experts, top-2
"""

from __future__ import annotations

import argparse
import os
import sys

# Llama shapes (GQA, head_dim 64, vocabulary of the tokenizer, untied embeddings).
PRESETS = {
    "llama-350m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=21,
                       num_attention_heads=16, num_key_value_heads=8),  # 0.349B with a 49,152 vocabulary
    "llama-1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=18,
                     num_attention_heads=32, num_key_value_heads=8),
    # A small Mixtral: 0.32B parameters, 0.15B of them active per token (2 of 8 experts).
    "mixtral-tiny": dict(model_type="mixtral", hidden_size=768, intermediate_size=1024, num_hidden_layers=12,
                         num_attention_heads=12, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2),
    # Published shapes (config.json of each), vocabulary and tied embeddings included: a vocabulary
    # larger than the tokenizer's only means some ids never decode, which a speed run never asks.
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
}


def build_random_model(path: str, preset: str = "llama-350m", tokenizer: str | None = None,
                       dtype: str = "bfloat16", seed: int = 0, max_position_embeddings: int = 4096,
                       **overrides) -> str:
    """`overrides` replace fields of the preset's shape (a dry run shrinks a preset's layers and width)."""
    import torch
    import transformers

    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    if tokenizer is None:
        from engine.loading.default_model import default_model_path

        tokenizer = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
    shape = {"vocab_size": len(tok), "tie_word_embeddings": False, **PRESETS[preset], **overrides}
    model_type = shape.pop("model_type", "llama")
    cfg = transformers.AutoConfig.for_model(
        model_type, head_dim=shape["hidden_size"] // shape["num_attention_heads"],
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        dtype=dtype, **shape,
    )
    torch.manual_seed(seed)
    # Initialising a 1B model's weights takes a CPU tens of seconds; a GPU, where there is one, well under one.
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    gen = os.path.join(path, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)  # no sampling defaults: benchmarks set their own
    n = sum(p.numel() for p in model.parameters())
    print(f"{path}: random {preset}, {n / 1e9:.3f}B parameters, {dtype}, vocabulary {cfg.vocab_size}")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.random_model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path")
    p.add_argument("--preset", default="llama-350m", choices=sorted(PRESETS))
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the embedded SmolLM2's)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    build_random_model(args.path, args.preset, args.tokenizer, args.dtype, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
