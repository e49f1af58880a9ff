"""Expert parallelism in `engine plan serve`: the engine's layout (--enable-expert-parallel: EP size = TP, whole
experts per TP rank, outputs summed by the TP all-reduce) and vLLM's, labelled as such (EP = DP x TP, all-to-all)."""

from __future__ import annotations

import json

import pytest

from engine.planning import ModelSpec, plan_serving
from engine.planning.cli import main
from tests.planning.plan_cli import plan as plan_process

SERVE = ["--model", "qwen3-30b-a3b", "--gpu-memory-gib", "80", "-tp", "2"]


def serve_json(capsys, *argv):
    assert main(["serve", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def engine_rank_bytes(cfg, tp: int, ep: int, dtype) -> int:
    """Parameter bytes of rank 0 of the engine's own model, built as a TP (and EP) rank builds it."""
    import torch

    from engine.distributed.state import (ExpertParallelState, PipelineParallelState, TensorParallelState,
                                          WorldState, reset_parallel_state, set_parallel_state)
    from engine.models.registry import model_class

    set_parallel_state(TensorParallelState(rank=0, size=tp), PipelineParallelState(), WorldState(),
                       ExpertParallelState(rank=0, size=ep))
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cpu"):
            model = model_class(cfg.model_type)(cfg, max_positions=256)
    finally:
        torch.set_default_dtype(default)
        reset_parallel_state()
    return sum(p.nbytes for p in model.parameters())


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_engine_expert_parallel_rank_holds_what_the_planner_counts(model_type):
    """The engine's rank 0 with TP 2, experts sliced (EP off) or whole (EP = TP = 2), in bfloat16 (its router in
    float32): the planner's weights per GPU, byte for byte. Both layouts hold experts / 2 of the expert weights."""
    import torch
    import transformers

    common = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, tie_word_embeddings=False)
    cfg = (transformers.MixtralConfig(intermediate_size=128, num_local_experts=8, num_experts_per_tok=2, **common)
           if model_type == "mixtral" else
           transformers.Qwen2MoeConfig(intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                       num_experts_per_tok=2, shared_expert_intermediate_size=64,
                                       decoder_sparse_step=1, mlp_only_layers=[1], use_sliding_window=False, **common))
    spec = ModelSpec.from_hf_config(cfg.to_dict())
    for ep in (1, 2):
        planned = plan_serving(spec, dtype_bytes=2, kv_dtype_bytes=2, max_model_len=256, tp=2, ep=ep,
                               ep_layout="engine", kv_cache_memory_bytes=1 << 26)
        assert planned.weights_per_gpu == engine_rank_bytes(cfg, 2, ep, torch.bfloat16), ep
        assert planned.ep_all_to_all_bytes_per_token == 0  # the TP all-reduce combines the experts' outputs


def test_plan_serve_enable_expert_parallel_is_the_engines_layout(capsys):
    tp2 = serve_json(capsys, *SERVE)
    engine_ep = serve_json(capsys, *SERVE, "--enable-expert-parallel")
    assert (engine_ep["expert_parallel"], engine_ep["ep_size"]) == ("engine", 2)
    assert engine_ep["weights_per_gpu"] == tp2["weights_per_gpu"]  # 64 whole experts or half of each of 128
    assert engine_ep["ep_all_to_all_bytes_per_token"] == 0 and tp2["expert_parallel"] == "tp"
    # TP 1: the engine turns expert parallelism on only across TP ranks; with one there is nothing to spread
    one = serve_json(capsys, "--model", "qwen3-30b-a3b", "--gpu-memory-gib", "80", "--enable-expert-parallel")
    assert (one["expert_parallel"], one["ep_size"]) == ("tp", 1)
    done = plan_process("serve", *SERVE, "--enable-expert-parallel")
    assert "on each of the 2 TP ranks (the engine's --enable-expert-parallel" in done.stdout


def test_plan_serve_expert_parallel_size_is_vllms_layout_and_says_so(capsys):
    spec = ModelSpec.from_preset("qwen3-30b-a3b")
    experts = len(spec.moe_layers) * spec.num_experts * spec.expert_params
    tp2 = serve_json(capsys, *SERVE)
    vllm = serve_json(capsys, *SERVE, "--expert-parallel-size", "4")
    assert (vllm["expert_parallel"], vllm["ep_size"]) == ("vllm", 4)
    assert tp2["weights_per_gpu"] - vllm["weights_per_gpu"] == 2 * (experts // 2 - experts // 4)  # bf16
    assert vllm["ep_all_to_all_bytes_per_token"] > 0
    done = plan_process("serve", *SERVE, "--ep", "4")
    assert "vLLM's expert parallelism, EP = DP x TP: not a layout of this engine" in done.stdout


@pytest.mark.parametrize("argv, flag, says", [
    ([*SERVE, "--enable-expert-parallel", "--ep", "4"], "--expert-parallel-size", "not both"),
    (["--model", "llama-2-7b", "--gpu-memory-gib", "80", "-tp", "2", "--enable-expert-parallel"],
     "--enable-expert-parallel", "dense model"),
    # Mixtral's 8 experts over 16 TP ranks: the engine's MoeConfig.shard_problem refuses it too
    (["--model", "mixtral-8x7b", "--gpu-memory-gib", "80", "-tp", "16", "--enable-expert-parallel"], "-tp",
     "multiple of it"),
    ([*SERVE, "--ep", "3"], "--ep", "multiple of the tensor-parallel size"),
    (["--model", "mixtral-8x7b", "--gpu-memory-gib", "80", "--ep", "3"], "--ep", "does not divide"),
])
def test_expert_parallel_errors_name_the_flag(argv, flag, says):
    done = plan_process("serve", *argv)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    last = done.stderr.splitlines()[-1]
    assert flag in last and says in last, done.stderr
