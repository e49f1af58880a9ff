"""Mixture-of-experts in the planner, against transformers' own models and the published totals."""

import json
import random

import pytest

from engine.planning.comm import moe_all_to_all_bytes
from engine.planning.spec import ModelSpec

from tests.planning.plan_cli import plan, plan_json

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ, BATCH, VOCAB = 32, 2, 256
TINY = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
            max_position_embeddings=SEQ, use_cache=False, num_experts_per_tok=2)
CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(num_hidden_layers=2, num_local_experts=4, **TINY),
    # layer 0 dense (decoder_sparse_step 2), 1 MoE, 2 dense, 3 dense (mlp_only_layers); a shared expert
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        num_hidden_layers=4, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=80,
        decoder_sparse_step=2, mlp_only_layers=[3], **TINY),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        num_hidden_layers=3, num_experts=4, moe_intermediate_size=32, head_dim=32, mlp_only_layers=[1], **TINY),
}


def tiny(name, attn="eager"):
    config = CONFIGS[name]()
    config._attn_implementation = attn
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model, ModelSpec.from_hf_config(model.config.to_dict())


@pytest.mark.parametrize("name", CONFIGS)
def test_parameter_and_tensor_counts_equal_transformers(name):
    model, spec = tiny(name)
    params = list(model.parameters())
    assert spec.params == sum(p.numel() for p in params)
    assert spec.param_tensors_per_gpu() == len(params)


@pytest.mark.parametrize("name", CONFIGS)
def test_active_parameters_are_those_a_token_touches(name):
    """Active = every parameter outside the experts (embeddings counted whole, as the published figures do)
    plus the experts whose slice of the stacked expert tensors gets gradient from a single token."""
    model, spec = tiny(name)
    ids = torch.randint(0, VOCAB, (1, 1))
    model(input_ids=ids).logits.square().sum().backward()
    touched = 0
    for param_name, p in model.named_parameters():
        if "experts." in param_name:  # stacked [E, ...]: count the experts whose slice got gradient
            touched += sum(p[e].numel() for e in range(p.shape[0]) if p.grad[e].abs().sum() > 0)
        else:
            touched += p.numel()
    assert spec.active_params == touched


@pytest.mark.parametrize("name", CONFIGS)
def test_training_states_exact_and_activations_within_2_percent(name):
    """Weights, gradients and AdamW state of every expert, byte for byte; activations against autograd's
    saved tensors (as tests/planning/test_measured.py counts them)."""
    from tests.planning.test_measured import saved_bytes_of_forward

    from engine.planning.activations import activation_memory
    from engine.planning.memory import model_state_memory

    for attn, kernel in (("eager", "eager"), ("sdpa", "flash")):
        model, spec = tiny(name, attn)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters())
        ids = torch.randint(0, VOCAB, (BATCH, SEQ))
        measured, loss = saved_bytes_of_forward(model, ids)
        loss.backward()
        optimizer.step()
        states = model_state_memory(spec, precision="float32", optimizer="adamw")
        params = list(model.parameters())
        assert states.weights == states.gradients == sum(p.nbytes for p in params)
        assert states.optimizer == sum(t.nbytes for s in optimizer.state.values() for t in s.values())
        predicted = activation_memory(spec, SEQ, BATCH, 4, attention=kernel).stored
        assert predicted == pytest.approx(measured, rel=0.02), (attn, predicted, measured)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_rank_holds_its_slice_of_the_real_tensors(name, ep):
    """Slice the real model as EP does (experts [r E/ep, (r+1) E/ep) on rank r, everything else whole)."""
    model, spec = tiny(name)
    per_rank = sum(p[: p.shape[0] // ep].numel() if "experts." in n else p.numel() for n, p in model.named_parameters())
    assert spec.params_per_gpu(expert_shards=ep) == per_rank
    assert spec.stage_params(expert_shards=ep).expert_elements == sum(
        p[: p.shape[0] // ep].numel() for n, p in model.named_parameters() if "experts." in n)


def _within_rounding(value, published, digits):
    """Within 0.5% of the interval a figure printed to `digits` decimals rounds from."""
    half = 0.5 * 10**-digits
    return (published - half) * 0.995 <= value <= (published + half) * 1.005


def test_published_mixtral_8x7b_totals():
    # Mistral AI, "Mixtral of experts" (2023-12-11): "46.7B total parameters but only uses 12.9B per token".
    spec = ModelSpec.from_preset("mixtral-8x7b")
    assert spec.params / 1e9 == pytest.approx(46.7, rel=0.005)
    assert spec.active_params / 1e9 == pytest.approx(12.9, rel=0.005)


def test_published_qwen3_30b_a3b_totals():
    # Qwen/Qwen3-30B-A3B model card: 30.5B in total, 3.3B activated, 29.9B non-embedding.
    spec = ModelSpec.from_preset("qwen3-30b-a3b")
    assert _within_rounding(spec.params / 1e9, 30.5, 1)
    assert _within_rounding(spec.active_params / 1e9, 3.3, 1)
    assert _within_rounding((spec.params - 2 * spec.vocab_size * spec.hidden_size) / 1e9, 29.9, 1)


def test_training_flops_are_6_x_active_parameters_x_tokens():
    out = plan_json("train", "--model", "mixtral-8x7b", "--seq-len", "4096", "--tokens", "1e12")
    assert out["flops"] == pytest.approx(6 * 12.9e9 * 1e12, rel=0.005)  # the published 12.9B active
    assert out["params"] == pytest.approx(46.7e9, rel=0.005)


def test_expert_parallel_shards_expert_states_and_zero_partitions_them_over_fewer_ranks():
    base = ["train", "--model", "mixtral-8x7b", "--seq-len", "4096", "--tokens", "1e9", "--nodes", "2",
            "--gpus-per-node", "8", "--tp", "2"]
    spec = ModelSpec.from_preset("mixtral-8x7b")
    experts = len(spec.moe_layers) * spec.num_experts * spec.expert_params
    no_ep, ep4 = plan_json(*base), plan_json(*base, "--ep", "4")
    # bf16 weights of the experts: all on each GPU (split over TP 2), then a quarter of them
    assert no_ep["memory_per_gpu"]["weights"] - ep4["memory_per_gpu"]["weights"] == 2 * experts / 2 * 3 / 4
    z1, z1_ep4 = plan_json(*base, "--zero", "1"), plan_json(*base, "--zero", "1", "--ep", "4")
    # 12 optimizer bytes per expert parameter: partitioned over 8 DP ranks, or over 8 / 4 with EP 4;
    # either way each GPU keeps 1/16 of the experts' optimizer states (dense states: 1/8 in both)
    assert z1["memory_per_gpu"]["optimizer"] == pytest.approx(z1_ep4["memory_per_gpu"]["optimizer"], rel=1e-6)
    assert ep4["ep_all_to_all_bytes"] > 0 and no_ep["ep_all_to_all_bytes"] == 0


def test_serving_kv_cache_is_the_attention_formula():
    # MoE leaves the KV formula alone; expert layouts: test_serving_ep.py
    tp2 = plan_json("serve", "--model", "qwen3-30b-a3b", "--gpu-memory-gib", "80", "-tp", "2")
    assert tp2["kv_bytes_per_token"] == 2 * 48 * 2 * 128 * 2


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_all_to_all_bytes_equal_a_count_of_routed_token_copies(ep):
    """Route tokens uniformly at random to top-k distinct experts, place experts on ranks in contiguous
    blocks, and count the hidden vectors that leave the token's rank (dispatch) and come back (combine)."""
    spec = ModelSpec.from_preset("mixtral-8x7b")
    rng, tokens, k, experts = random.Random(0), 40_000, spec.experts_per_token, spec.num_experts
    home = [rng.randrange(ep) for _ in range(tokens)]
    leaving = sum(e * ep // experts != home[t] for t in range(tokens) for e in rng.sample(range(experts), k))
    counted = 2 * leaving * spec.hidden_size * 2 * len(spec.moe_layers)  # dispatch + combine, bf16, all layers
    assert moe_all_to_all_bytes(spec, tokens, 2, ep) == pytest.approx(counted, rel=0.02)


DEEPSEEK = {"deepseek_v3": "kv_lora_rank", "deepseek_v2": "kv_lora_rank", "olmoe": "num_experts"}


@pytest.mark.parametrize("model_type, field", DEEPSEEK.items())
def test_moe_variants_not_modelled_are_refused_naming_the_field(tmp_path, model_type, field):
    config = transformers.AutoConfig.for_model(model_type)
    with pytest.raises(ValueError, match=field):
        ModelSpec.from_hf_config(config.to_dict())
    config.save_pretrained(tmp_path)
    done = plan("serve", "--model", str(tmp_path), "--gpu-memory-gib", "80")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert field in done.stderr.splitlines()[-1] and "not modelled" in done.stderr


def test_more_experts_per_token_than_experts_is_refused(tmp_path):
    config = CONFIGS["mixtral"]().to_dict() | {"num_experts_per_tok": 5}
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelSpec.from_hf_config(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    done = plan("train", "--model", str(tmp_path), "--seq-len", "8", "--tokens", "8")
    assert done.returncode == 2 and "num_experts_per_tok" in done.stderr.splitlines()[-1]


@pytest.mark.parametrize("argv", [
    ["train", "--model", "mixtral-8x7b", "--seq-len", "8", "--tokens", "8", "--gpus-per-node", "3", "--ep", "3"],
    ["train", "--model", "llama-2-7b", "--seq-len", "8", "--tokens", "8", "--gpus-per-node", "2", "--ep", "2"],
    ["train", "--model", "mixtral-8x7b", "--seq-len", "8", "--tokens", "8", "--gpus-per-node", "2", "--ep", "4"],
    ["serve", "--model", "mixtral-8x7b", "--gpu-memory-gib", "80", "--ep", "3"],
    ["serve", "--model", "mixtral-8x7b", "--gpu-memory-gib", "80", "-tp", "4", "--ep", "2"],
])
def test_bad_expert_parallel_sizes_are_argparse_errors(argv):
    done = plan(*argv)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--ep" in done.stderr.splitlines()[-1], done.stderr


@pytest.mark.parametrize("name", CONFIGS)
def test_engine_plan_reads_the_saved_config_json(tmp_path, name):
    model, _ = tiny(name)
    model.config.save_pretrained(tmp_path)
    out = plan_json("serve", "--model", str(tmp_path), "--gpu-memory-gib", "1", "--dtype", "float32")
    assert out["params"] == sum(p.numel() for p in model.parameters())
    assert out["weights_per_gpu"] == sum(p.nbytes for p in model.parameters())
