"""The engine's side of the token-parity tests: one engine, a batch of prompts, greedy tokens."""

from __future__ import annotations


def engine_greedy(path, prompts: list[list[int]], max_tokens: int, **config) -> list[list[int]]:
    """Each prompt's greedy output ids (EOS ignored) from an LLM built with `config`, shut down after;
    on the CPU unless `config` names a device (the callers compare float32 tokens exactly)."""
    from engine import LLM, SamplingParams

    llm = LLM(str(path), **{"device": "cpu", **config})
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]
