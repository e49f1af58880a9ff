"""The per-step cost of structured output's masking on CPU: filling 32 matchers' bitmasks, then
applying the mask to 32 x vocabulary float32 logits with xgrammar's own CPU op, the torch
reference and the C++ op (kernels/cpu_ops.cpp). Default model's tokenizer; ms per call, mean
of 20 after one warm-up call each.

    python benchmarks/structured-output/mask_cost.py
"""

import time

import torch
import xgrammar as xgr

import kernels
from engine.config import EngineConfig
from engine.loading.loader import resolve_model
from engine.sampling_params import GrammarSpec
from engine.structured_output import StructuredOutputs
from kernels import reference

src = resolve_model(None)
vocab = src.hf_config.vocab_size
grammars = StructuredOutputs(src.tokenizer, vocab, src.eos_token_ids, kernels.get_backend("cpu").apply_token_bitmask,
                             EngineConfig())
spec = GrammarSpec.of("json", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                               "minItems": 100, "maxItems": 100})
matchers = [grammars.matcher(spec, None, []) for _ in range(32)]
bitmask = xgr.allocate_token_bitmask(32, vocab)
logits = torch.randn(32, vocab)


def ms(fn, reps=20) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def fill():
    for row, m in enumerate(matchers):
        m.fill_next_token_bitmask(bitmask, row)


print(f"fill 32 bitmasks: {ms(fill):.3f} ms")
print(f"xgrammar apply_token_bitmask_inplace: {ms(lambda: xgr.apply_token_bitmask_inplace(logits, bitmask)):.3f} ms")
print(f"torch reference: {ms(lambda: reference.apply_token_bitmask(logits, bitmask)):.3f} ms")
print(f"C++ apply_token_bitmask_: {ms(lambda: kernels.get_backend('cpu').apply_token_bitmask(logits, bitmask)):.3f} ms")
