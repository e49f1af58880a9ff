"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers.

Float32 greedy parity under chunked prefill and preemption is in test_parity.py (the MoE families
are in its FAMILIES); here: prefix caching with n > 1, bfloat16 logprobs, the checkpoint layouts
experts come in, and the errors a config can cause.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.conftest import MOE_FAMILIES
from tests.engine.hf_oracle import assert_first_tokens_close, hf_greedy


def _prompts(seed: int, n: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_prefix_cache_and_n_choices_keep_transformers_tokens(family, tiny_models):
    """n = 3 greedy choices of prompts sharing a 48-token prefix: the prefix is computed once and
    shared, and every choice is transformers' greedy continuation."""
    path = tiny_models(family)
    prefix = _prompts(1, 1, 48, 49)[0]
    prompts = [prefix + tail for tail in _prompts(2, 4, 1, 12)]
    llm = LLM(path, device="cpu", num_kv_blocks=128, block_size=16, max_model_len=256, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=3)
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    rest = llm.generate(prompts[1:], params, use_tqdm=False)
    assert all(o.num_cached_tokens == 48 for o in rest)
    for prompt, out in zip(prompts, first + rest):
        expected = hf_greedy(path, prompt, 8)
        assert [c.token_ids for c in out.outputs] == [expected] * 3
    assert llm.engine.stats()["num_used_blocks"] == 0


@pytest.fixture(scope="module")
def hf_bf16():
    from transformers import AutoModelForCausalLM

    models = {}

    def get(path):
        if path not in models:
            # The eager loop over experts: torch's grouped GEMM (transformers' default) wants row
            # strides in multiples of 16 bytes, which these deliberately odd expert sizes are not.
            models[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                                experts_implementation="eager").eval()
        return models[path]

    return get


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_bfloat16_first_tokens_and_logprobs_close_to_transformers(family, tiny_models, hf_bf16):
    """bfloat16 rounds differently in each engine (the router here is float32, transformers' is
    bfloat16), and these random routers have near ties (top-2 vs third expert within 0.001 in
    probability): one flipped choice anywhere in a prompt moves the last logprob by up to ~1. So:
    the first tokens agree, the typical logprob gap is bfloat16 noise, and none is far off."""
    path = tiny_models(family)
    llm = LLM(path, device="cpu", dtype="bfloat16", num_kv_blocks=64, max_model_len=256)
    assert_first_tokens_close(llm, hf_bf16(path), _prompts(3, 8, 2, 40))


def _rewrite(src: str, dst, transform) -> str:
    """A copy of checkpoint folder `src` whose tensors pass through transform(dict) -> dict."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(f"{dst}/model.safetensors")
    save_file(transform(tensors), f"{dst}/model.safetensors", metadata={"format": "pt"})
    return str(dst)


def _stack_experts(tensors: dict) -> dict:
    """transformers 5's in-memory layout: one [experts, 2 * ffn, hidden] gate_up_proj and one
    [experts, hidden, ffn] down_proj per layer, instead of a tensor per expert matrix."""
    out, stacks = {}, {}
    for name, t in tensors.items():
        if ".experts." in name:
            layer, rest = name.split(".mlp.experts.")
            expert, part = rest.split(".")[:2]
            stacks.setdefault(layer, {}).setdefault(part, {})[int(expert)] = t
        else:
            out[name] = t
    for layer, parts in stacks.items():
        def stack(part):
            return torch.stack([parts[part][e] for e in sorted(parts[part])])
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.cat([stack("gate_proj"), stack("up_proj")], dim=1)
        out[f"{layer}.mlp.experts.down_proj"] = stack("down_proj")
    return out


def test_stacked_and_sharded_expert_checkpoints_load_alike(tiny_models, tmp_path):
    """The same Qwen3-MoE weights as one tensor per expert matrix, stacked per layer, and split over
    several safetensors shards: the same greedy tokens as transformers."""
    from transformers import AutoModelForCausalLM

    path = tiny_models("qwen3_moe")
    stacked = _rewrite(path, tmp_path / "stacked", _stack_experts)
    sharded = tmp_path / "sharded"
    shutil.copytree(path, sharded, ignore=shutil.ignore_patterns("*.safetensors"))
    AutoModelForCausalLM.from_pretrained(path).save_pretrained(sharded, max_shard_size="100KB")
    assert len(list(sharded.glob("*.safetensors"))) > 2
    prompts = _prompts(4, 3, 3, 30)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = [hf_greedy(path, p, 8) for p in prompts]
    for folder in (stacked, str(sharded)):
        llm = LLM(folder, device="cpu", num_kv_blocks=64, max_model_len=256)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected


def _edited_config(src: str, dst, **changes) -> str:
    shutil.copytree(src, dst)
    with open(f"{dst}/config.json") as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(f"{dst}/config.json", "w") as f:
        json.dump(cfg, f)
    return str(dst)


def test_more_experts_per_token_than_experts_is_named(tiny_models, tmp_path):
    path = _edited_config(tiny_models("mixtral"), tmp_path / "m", num_experts_per_tok=9)
    with pytest.raises(ValueError, match=r"'num_experts_per_tok': 9 experts per token, but the model has 8 experts"):
        LLM(path, device="cpu", num_kv_blocks=16)


def test_expert_parallel_needs_experts_and_a_dividing_size(tiny_models):
    with pytest.raises(ValueError, match="enable_expert_parallel is for mixture-of-experts models"):
        LLM(tiny_models("llama"), device="cpu", num_kv_blocks=16, enable_expert_parallel=True)

def test_expert_parallel_size_must_divide_the_experts(tiny_models, tmp_path):
    path = _edited_config(tiny_models("mixtral"), tmp_path / "six", num_local_experts=6)
    with pytest.raises(ValueError, match=r"number of experts \(6\) to be a multiple of it"):
        LLM(path, num_kv_blocks=16, tensor_parallel_size=4, enable_expert_parallel=True, device="cpu")


def test_sliced_experts_need_a_dividing_size_and_the_error_offers_expert_parallel(tiny_models, tmp_path):
    path = _edited_config(tiny_models("mixtral"), tmp_path / "odd", intermediate_size=35)
    with pytest.raises(ValueError, match=r"does not divide the experts' intermediate size 35.*enable-expert-parallel"):
        LLM(path, num_kv_blocks=16, tensor_parallel_size=2, device="cpu")


def test_unsupported_moe_variant_is_refused_by_name(tiny_models, tmp_path):
    """DeepSeek's MLA and grouped routing are not built: refused at load, naming the type."""
    path = _edited_config(tiny_models("mixtral"), tmp_path / "d", model_type="deepseek_v3",
                          architectures=["DeepseekV3ForCausalLM"], kv_lora_rank=16, n_group=4, topk_group=2)
    with pytest.raises(ValueError, match=r"model_type 'deepseek_v3' is not supported.*mixtral"):
        LLM(path, device="cpu", num_kv_blocks=16)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sliced-experts", "expert-parallel"])
@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "stacked"])
def test_two_ranks_shares_add_up_to_every_expert(expert_parallel, stacked):
    """Each rank builds and loads its share of a layer's experts (a slice of every expert's ffn, or
    4 whole experts of 8) from the same checkpoint tensors; their partial outputs add up to the
    output of all experts, whole, on one process."""
    from engine.distributed import state
    from engine.layers.moe import FusedMoE
    from kernels import reference

    experts, top_k, hidden, ffn, tokens = 8, 2, 24, 10, 13
    gen = torch.Generator().manual_seed(0)
    gate, up = torch.randn(experts, ffn, hidden, generator=gen), torch.randn(experts, ffn, hidden, generator=gen)
    down = torch.randn(experts, hidden, ffn, generator=gen)
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = reference.select_experts(torch.randn(tokens, experts, generator=gen), top_k, renormalize=True)
    expected = reference.fused_moe(x, weights, ids, torch.cat([gate, up], dim=1), down)
    total = torch.zeros_like(expected)
    try:
        for rank in range(2):
            ep = state.ExpertParallelState(rank, 2) if expert_parallel else state.ExpertParallelState()
            state.set_parallel_state(state.TensorParallelState(rank, 2), state.PipelineParallelState(),
                                     state.WorldState(), ep)
            layer = FusedMoE(experts, top_k, hidden, ffn, renormalize=True)
            if stacked:
                layer.w13.weight_loader(layer.w13, torch.cat([gate, up], dim=1), (None, "gate_up"))
                layer.w2.weight_loader(layer.w2, down, (None, "down"))
            else:
                for e in range(experts):
                    layer.w13.weight_loader(layer.w13, gate[e], (e, "gate"))
                    layer.w13.weight_loader(layer.w13, up[e], (e, "up"))
                    layer.w2.weight_loader(layer.w2, down[e], (e, "down"))
            local = (4, 2 * ffn, hidden) if expert_parallel else (8, ffn, hidden)
            assert tuple(layer.w13.shape) == local and layer.expert_offset == (4 * rank if expert_parallel else 0)
            total += reference.fused_moe(x, weights, ids, layer.w13, layer.w2, layer.expert_offset)
    finally:
        state.reset_parallel_state()
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-4)
