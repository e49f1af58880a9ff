"""LoRA and QLoRA in the planner: the trainable parameters against PEFT itself, the adapters' split over TP,
and the serving plan's adapter slots against a hand count."""

import peft
import pytest
import transformers

from engine.planning.lora import (
    LORA_TARGETS,
    LoraSpec,
    adapter_params,
    adapter_slot_bytes,
    adapter_tensors,
    frozen_base_bytes,
)
from engine.planning.memory import model_state_memory
from engine.planning.spec import ModelSpec
from tests.planning.plan_cli import plan, plan_json

TINY = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128)
MODELS = {
    "llama-gqa": ("llama", dict(TINY, num_key_value_heads=2, intermediate_size=96)),
    "llama-tied-head-dim": ("llama", dict(TINY, num_key_value_heads=1, intermediate_size=80, head_dim=24,
                                          tie_word_embeddings=True)),
    "qwen2-biases": ("qwen2", dict(TINY, num_key_value_heads=2, intermediate_size=96)),
    # layer 0 an MoE layer with a shared expert, layer 1 a dense MLP: routed experts are never adapted
    "qwen2-moe": ("qwen2_moe", dict(TINY, num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                                    decoder_sparse_step=1, mlp_only_layers=[1])),
}
TARGETS = [("q", "v"), ("o", "down"), LORA_TARGETS]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("targets", TARGETS, ids=lambda t: ",".join(t))
def test_trainable_parameters_equal_peft_count(model, targets):
    model_type, fields = MODELS[model]
    config = transformers.AutoConfig.for_model(model_type, **fields)
    base = transformers.AutoModelForCausalLM.from_config(config)
    lora = peft.LoraConfig(r=7, lora_alpha=16, target_modules=[f"{t}_proj" for t in targets])
    trainable, _ = peft.get_peft_model(base, lora).get_nb_trainable_parameters()
    spec = ModelSpec.from_hf_config(config.to_dict())
    assert adapter_params(spec, LoraSpec(r=7, target_modules=targets, lora_alpha=16)) == trainable  # exact


def test_tensor_parallel_splits_adapters_as_their_projections():
    # Column-parallel q/k/v/gate/up: A whole, B split by output; row-parallel o/down: A split by input, B whole.
    spec = ModelSpec.from_preset("llama-3-8b")  # h 4096, 32 heads, 8 KV heads of 128, ffn 14336, 32 layers
    h, q, kv, f, r, tp = 4096, 4096, 1024, 14336, 16, 2
    per_layer = (r * h + q * r // tp) + 2 * (r * h + kv * r // tp) + (r * q // tp + h * r) \
        + 2 * (r * h + f * r // tp) + (r * f // tp + h * r)
    adapters = adapter_tensors(spec, LoraSpec(r=r, target_modules=LORA_TARGETS))
    assert spec.extra_tensors_per_gpu(adapters, tp=tp).elements == 32 * per_layer


@pytest.mark.parametrize("tp", [1, 2])
def test_serve_max_loras_adds_the_hand_counted_slots_and_takes_them_from_the_kv_cache(tp):
    # vLLM's slots: for each of --max-loras, A [rank, in] and B [out, rank] of q, k, v, o, gate, up, down in
    # every layer, in the serving dtype (bfloat16: 2 bytes), split over TP as the projections are.
    h, q, kv, f, layers, rank, slots = 4096, 4096, 1024, 14336, 32, 32, 3
    a_and_b = [(h, q, False), (h, kv, False), (h, kv, False), (q, h, True), (h, f, False), (h, f, False), (f, h, True)]
    per_layer = sum(rank * (i // tp if row else i) + rank * (o if row else o // tp) for i, o, row in a_and_b)
    expected = slots * layers * per_layer * 2
    base = ["serve", "--model", "llama-3-8b", "--gpu-memory-gib", "80", "--max-model-len", "8192", "-tp", str(tp)]
    without, with_slots = plan_json(*base), plan_json(*base, "--max-loras", str(slots), "--max-lora-rank", str(rank))
    assert with_slots["lora_slot_bytes"] == expected
    assert with_slots["weights_per_gpu"] - without["weights_per_gpu"] == expected
    assert without["kv_budget_bytes"] - with_slots["kv_budget_bytes"] == expected
    assert adapter_slot_bytes(ModelSpec.from_preset("llama-3-8b"), slots, rank, 2, tp) == expected


def test_plan_train_lora_as_a_user_types_it():
    done = plan("train", "--model", "llama-2-7b", "--seq-len", "2048", "--tokens", "1e8", "--lora-rank", "16",
                "--lora-targets", "q,k,v,o,gate,up,down", "--lora-alpha", "32", "--base-quantization", "nf4",
                "--gpu", "rtx-4090")
    assert done.returncode == 0, done.stderr
    # r (in + out) per projection per layer: 16 x 32 layers x (4 x 8192 + 3 x 15104)
    assert "trainable parameters    39,976,960 (0.593%): LoRA r 16, alpha 32 (scale 2)" in done.stdout
    assert "linear layers in NF4 + double quantization (4.127 bits a weight)" in done.stdout
    assert "fits                 yes (in 24.00 GiB)" in done.stdout
    explained = plan("train", "--model", "llama-2-7b", "--seq-len", "2048", "--tokens", "1e8", "--lora-rank", "16",
                     "--explain").stdout
    assert "2 B x adapter parameters (the base gets none)" in explained
    full = plan_json("train", "--model", "llama-2-7b", "--seq-len", "2048", "--tokens", "1e8")
    lora = plan_json("train", "--model", "llama-2-7b", "--seq-len", "2048", "--tokens", "1e8", "--lora-rank", "16")
    assert full["trainable_params"] == full["params"] and lora["trainable_params"] == 16 * 32 * 2 * 8192
    assert lora["flops"] < full["flops"] and lora["memory_per_gpu"]["optimizer"] < full["memory_per_gpu"]["optimizer"]


def test_zero_partitions_the_adapters_states_and_zero_3_the_frozen_base_too():
    # ZeRO's rules (Rajbhandari et al. 2020, Figure 1) on what trains: the adapters' states partition over the
    # 8 DP ranks by stage; the frozen base has no gradient or optimizer state, and only ZeRO-3 partitions it.
    spec, lora = ModelSpec.from_preset("llama-2-7b"), LoraSpec(16, LORA_TARGETS, base_quantization="nf4")
    n, tensors = adapter_params(spec, lora), 2 * 7 * 32  # A and B of 7 projections in 32 layers
    frozen = frozen_base_bytes(spec, lora, 2)
    states = {z: model_state_memory(spec, lora=lora, dp=8, zero=z) for z in (0, 1, 2, 3)}
    zero0 = states[0]
    assert (zero0.weights, zero0.gradients, zero0.optimizer) == (frozen + 2 * n, 2 * n, 12 * n + 4 * tensors)
    assert states[1].optimizer == -(-(12 * n + 4 * tensors) // 8) and states[1].gradients == 2 * n
    assert states[2].gradients == -(-2 * n // 8) and states[2].weights == frozen + 2 * n
    assert states[3].weights == frozen_base_bytes(spec, lora, 2, dense_ranks=8) + -(-2 * n // 8)
    assert states[3].weights < frozen / 7
