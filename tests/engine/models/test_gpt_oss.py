"""gpt-oss (engine/models/gpt_oss.py) against transformers: greedy token for token in float32 on tiny
random models, with prompts past the sliding window, prefill in chunks that cross it, a prefix-cache hit
and preemption, and from a checkpoint whose experts are MXFP4 blocks (the oracle: transformers on the
same weights dequantized by transformers' own MXFP4 code). Each feature (sinks, the window, the biases,
the clamp) is shown to change transformers' own answer, so a parity test passing proves it is computed."""

from __future__ import annotations

import json
import os

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.hf_oracle import hf_greedy
from tests.tiny_model import build_tokenizer

WINDOW = 8
PROMPTS = [[5, 17, 33, 9, 100, 41, 7, 8], list(range(100, 150)), [3, 4, 5], [7, 8, 9] * 12]
MAX_TOKENS = 8


def build_tiny_gpt_oss(path, seed: int = 0, **overrides) -> str:
    """A random float32 gpt-oss and the test tokenizer in `path`: 4 layers alternating window and full
    attention, 4 experts of which 2 a token, YaRN; sinks and biases drawn (transformers starts them at
    zero), and a clamp low enough to bite."""
    import transformers

    tokenizer = build_tokenizer()
    args = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=32, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                sliding_window=WINDOW, max_position_embeddings=512, initializer_range=0.2, swiglu_limit=1.0,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 128, "rope_theta": 150000.0})
    config = transformers.GptOssConfig(**{**args, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.normal_(0.0, 2.0)
            elif "bias" in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def engine_tokens(path, **config) -> list[list[int]]:
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=128, block_size=8, **config)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
        again = llm.generate(PROMPTS[1:2], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                             use_tqdm=False)  # the long prompt's blocks come from the prefix cache now
        assert again[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
        assert llm.engine.stats()["prefix_cache_hits"] > 0
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def oracle(path) -> list[list[int]]:
    return [hf_greedy(str(path), p, MAX_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return build_tiny_gpt_oss(tmp_path_factory.mktemp("gpt-oss"))


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_tokens_equal_transformers(gpt_oss, backend):
    # A 16-token step budget: the 50-token prompt's prefill runs in chunks that cross the window's edge.
    assert engine_tokens(gpt_oss, attention_backend=backend, max_num_batched_tokens=16) == oracle(gpt_oss)


def test_preempted_requests_recompute_the_same_tokens(gpt_oss):
    # 12 blocks of 8 tokens for four requests that need more: some are preempted and recomputed.
    llm = LLM(gpt_oss, device="cpu", dtype="float32", num_kv_blocks=12, block_size=8, max_num_batched_tokens=32)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
        assert llm.engine.stats()["num_preemptions"] > 0
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == oracle(gpt_oss)


@pytest.mark.parametrize("change", ["no sinks", "no window", "no biases", "no clamp"])
def test_each_feature_changes_the_oracle(gpt_oss, tmp_path, change):
    """A parity test can only prove what changes the answer: each feature, turned off in a copy of the
    model, changes transformers' greedy tokens on these prompts."""
    overrides = {"no window": dict(sliding_window=4096), "no clamp": dict(swiglu_limit=1e9)}.get(change, {})
    other = build_tiny_gpt_oss(tmp_path / "other", **overrides)
    if change in ("no sinks", "no biases"):
        from safetensors.torch import load_file, save_file

        file = os.path.join(other, "model.safetensors")
        tensors = load_file(file)
        for name in tensors:
            if name.endswith("sinks" if change == "no sinks" else "bias"):
                tensors[name] = torch.full_like(tensors[name], -1e4 if change == "no sinks" else 0.0)
        save_file(tensors, file, metadata={"format": "pt"})
    assert oracle(other) != oracle(gpt_oss)


def _mxfp4(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, rows, cols] float -> (blocks uint8 [E, rows, cols / 32, 16], scales uint8 [E, rows, cols / 32]):
    each group of 32 scaled by a power of two so its largest magnitude fits e2m1's 6, then rounded to the
    nearest e2m1 value (the low nibble first)."""
    from engine.quant.mxfp4 import E2M1

    groups = weights.reshape(*weights.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    table = torch.tensor(E2M1)
    codes = (scaled.unsqueeze(-1) - table).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def test_a_checkpoint_with_mxfp4_experts_loads_them_dequantized(gpt_oss, tmp_path):
    """The released gpt-oss checkpoints store each layer's experts as MXFP4 blocks and scales: the engine
    on such a checkpoint equals transformers on the same weights dequantized by transformers' own code."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = load_file(os.path.join(gpt_oss, "model.safetensors"))
    packed, dequantized = dict(tensors), dict(tensors)
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = _mxfp4(t.transpose(1, 2).contiguous())  # stored [E, out, in] as the hub files
            del packed[name]
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    folders = {}
    for kind, weights in (("mxfp4", packed), ("float", dequantized)):
        folder = tmp_path / kind
        folder.mkdir()
        for file in os.listdir(gpt_oss):
            if file != "model.safetensors":
                (folder / file).write_bytes((open(os.path.join(gpt_oss, file), "rb")).read())
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        folders[kind] = folder
    config = json.loads((folders["mxfp4"] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folders["mxfp4"] / "config.json").write_text(json.dumps(config))
    assert not torch.equal(dequantized[next(n for n in dequantized if n.endswith("experts.down_proj"))],
                           tensors[next(n for n in tensors if n.endswith("experts.down_proj"))])  # 4 bits changed them
    assert engine_tokens(folders["mxfp4"]) == oracle(folders["float"])


def test_tensor_parallel_is_refused_in_one_line_and_leaves_no_rank_behind(gpt_oss):
    import time

    from tests.parallel.helpers import engine_processes

    with pytest.raises(Exception, match="gpt-oss with tensor_parallel_size > 1 is not supported"):
        LLM(gpt_oss, device="cpu", dtype="float32", tensor_parallel_size=2, num_kv_blocks=32, num_threads=1)
    deadline = time.monotonic() + 10
    while engine_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine_processes() == []
