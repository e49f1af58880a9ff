"""The engine's side of the token-parity tests: one engine, a batch of prompts, greedy tokens; and
a model loaded as the engine loads it, for tests that inspect its weights."""

from __future__ import annotations


def engine_greedy(path, prompts: list[list[int]], max_tokens: int, **config) -> list[list[int]]:
    """Each prompt's greedy output ids (EOS ignored) from an LLM built with `config`, shut down after;
    on the CPU unless `config` names a device, in float32 unless it names a dtype (the callers compare
    float32 tokens exactly; "auto" would compute a 16-bit checkpoint in bf16 on a CPU with native bf16)."""
    from engine import LLM, SamplingParams

    llm = LLM(str(path), **{"device": "cpu", "dtype": "float32", **config})
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def loaded_model(path, keep_bf16: bool = False, **source):
    """The model at `path` built on the CPU and loaded as the runner loads it (resolve_model, then
    load_weights(checkpoint_tensors)), without packing or a KV cache; `source` goes to resolve_model
    (gguf_weights, quantization, ...), keep_bf16 to checkpoint_tensors."""
    import torch

    from engine.loading.loader import resolve_model
    from engine.loading.weights import checkpoint_tensors, load_weights
    from engine.models.registry import model_class

    resolved = resolve_model(str(path), **source)
    with torch.device("cpu"):
        model = model_class(resolved.hf_config.model_type)(resolved.hf_config, max_positions=256)
    load_weights(model, checkpoint_tensors(resolved, keep_bf16))
    return model
