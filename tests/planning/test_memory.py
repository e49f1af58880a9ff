"""Training memory: what each ZeRO stage, offload, TP, PP and recomputation setting does to each term."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.planning.activations import activation_memory, layer_activation_bytes
from engine.planning.memory import model_state_memory, optimizer_bytes_per_param
from engine.planning.spec import ModelSpec

LLAMA_7B = ModelSpec.from_preset("llama-2-7b")


@pytest.mark.parametrize("precision, optimizer, k", [
    ("mixed", "adamw", 12), ("mixed", "adamw8bit", 6), ("mixed", "sgd", 8),
    ("float32", "adamw", 8), ("bfloat16", "adamw", 4), ("float16", "sgd", 2), ("float32", "adamw8bit", 2),
])
def test_optimizer_bytes_per_parameter(precision, optimizer, k):
    assert optimizer_bytes_per_param(precision, optimizer) == k


def test_zero_stages_partition_one_more_state_each():
    spec = LLAMA_7B.with_params(6_400_000_000)
    base = model_state_memory(spec, optimizer="sgd", dp=64, zero=0)
    psi = 6_400_000_000
    assert (base.weights, base.gradients, base.optimizer) == (2 * psi, 2 * psi, 8 * psi)
    s1, s2, s3 = (model_state_memory(spec, optimizer="sgd", dp=64, zero=z) for z in (1, 2, 3))
    assert (s1.weights, s1.gradients, s1.optimizer) == (2 * psi, 2 * psi, 8 * psi // 64)
    assert (s2.weights, s2.gradients, s2.optimizer) == (2 * psi, 2 * psi // 64, 8 * psi // 64)
    assert (s3.weights, s3.gradients, s3.optimizer) == (2 * psi // 64, 2 * psi // 64, 8 * psi // 64)


def test_offload_moves_partitions_to_cpu():
    on_gpu = model_state_memory(LLAMA_7B, dp=8, zero=3)
    opt = model_state_memory(LLAMA_7B, dp=8, zero=3, offload="optimizer")
    assert (opt.gradients, opt.optimizer, opt.weights) == (0, 0, on_gpu.weights)
    assert opt.cpu == on_gpu.gradients + on_gpu.optimizer
    both = model_state_memory(LLAMA_7B, dp=8, zero=3, offload="optimizer+params")
    assert both.weights == 0 and both.cpu == opt.cpu + on_gpu.weights


def test_tensor_and_pipeline_parallel_weights_per_gpu():
    h, v, total = 4096, 32000, LLAMA_7B.params
    norms = (2 * 32 + 1) * h  # replicated on every TP rank
    assert LLAMA_7B.params_per_gpu(tp=2) == (total - norms) // 2 + norms
    layer = (total - 2 * v * h - h) // 32
    assert LLAMA_7B.params_per_gpu(pp=2) == 16 * layer + h + v * h  # last stage: 16 layers, final norm, head
    tied = ModelSpec.from_preset("qwen2.5-0.5b")  # tied: the last stage keeps its own copy as the head
    assert tied.params_per_gpu(pp=2) > tied.params / 2


def test_pipeline_first_stage_holds_pp_micro_batches_of_its_layers():
    kw = dict(attention="flash", recompute="full")
    one = activation_memory(LLAMA_7B, 4096, 1, 2, **kw)
    four = activation_memory(LLAMA_7B, 4096, 1, 2, pp=4, num_micro_batches=8, **kw)
    assert four.per_layer == one.per_layer
    # first stage: 4 micro-batches x 8 layers = 32 layers' worth, as without pipelining
    assert four.stored == 32 * four.per_layer + 4 * 8 * 4096  # plus 4 micro-batches of int64 token ids
    few = activation_memory(LLAMA_7B, 4096, 1, 2, pp=4, num_micro_batches=2, **kw)
    assert few.stored < four.stored  # only 2 micro-batches ever in flight


def test_recomputation_keeps_a_layer_to_rebuild():
    full = activation_memory(LLAMA_7B, 4096, 1, 2, recompute="full", attention="eager")
    none = layer_activation_bytes(LLAMA_7B, 4096, 1, 2, attention="eager")
    assert full.recompute_buffer == none and full.total == full.stored + none


dims = st.tuples(
    st.integers(1, 8), st.sampled_from([64, 128, 256]), st.sampled_from([(4, 4), (4, 2), (8, 1), (8, 8)]),
    st.integers(32, 1024), st.sampled_from(["llama", "gpt"]),
)


@settings(max_examples=60, deadline=None)
@given(dims, st.sampled_from([1, 2, 4]), st.integers(1, 512), st.sampled_from(["eager", "flash"]))
def test_more_recomputation_and_parallelism_never_costs_memory(d, tp, seq, attention):
    layers, hidden, (heads, kv), vocab, arch = d
    spec = ModelSpec.from_dims(layers=layers, hidden=hidden, heads=heads, vocab=vocab, ffn_hidden=4 * hidden,
                               kv_heads=kv if arch == "llama" else None, arch=arch)
    per_layer = {
        rc: layer_activation_bytes(spec, seq, 2, 2, attention=attention, tp=tp, recompute=rc)
        for rc in ("none", "selective", "full")
    }
    assert per_layer["full"] <= per_layer["selective"] <= per_layer["none"]
    sp = layer_activation_bytes(spec, seq, 2, 2, attention=attention, tp=tp, sequence_parallel=True)
    assert sp <= per_layer["none"]
    assert layer_activation_bytes(spec, seq, 2, 2, attention=attention, tp=1) >= per_layer["none"]
    states = [model_state_memory(spec, dp=4, zero=z) for z in range(4)]
    totals = [s.weights + s.gradients + s.optimizer for s in states]
    assert totals == sorted(totals, reverse=True)
