"""Gemma 2 and Gemma 3 text (engine/models/gemma.py) against transformers: greedy token for token in
float32 on tiny random models, with prompts past the sliding window, prefill in chunks that cross it,
preemption and a prefix-cache hit; final-logit soft-capping by the logprobs (it never moves the
argmax). Each feature is shown to change transformers' own answer on these prompts, so a parity test
passing proves the engine computes it."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.support import UnsupportedModelError, check_supported
from tests.engine.hf_oracle import hf_greedy, hf_logits
from tests.tiny_model import build_tokenizer

if not torch.cuda.is_available():
    # The triton case runs its kernels under Triton's interpreter, as tests/kernels does; the choice is
    # read when kernels/triton_*.py are first imported (the engine imports them lazily).
    os.environ.setdefault("TRITON_INTERPRET", "1")

WINDOW = 8
LENGTHS = [5, 20, 37, 90]  # all but the first past the window
MAX_TOKENS = 6
ALTERNATING = ["sliding_attention", "full_attention"] * 2

# name -> (config class, fields): Gemma 2 with soft caps small enough to bite; Gemma 3 with its hub
# models' rotary (window layers base 10k, full layers 1M with linear scaling x8) and a window pattern of
# its own; a query_pre_attn_scalar other than head_dim, so the scale is checked too.
MODELS = {
    "gemma2": ("Gemma2Config", dict(attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", dict(
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})),
}


def build_tiny_gemma(path, name: str, seed: int = 0, **overrides) -> str:
    """A random float32 Gemma model and the test tokenizer in `path`. transformers starts the norms at 0
    (a scale of 1 + 0): random ones check each norm's place and its + 1; embeddings scaled down so that
    the layers, not the last token's scaled embedding, choose the next token (the tied head, scaled down
    with them, is scaled up again by the final norm)."""
    import transformers

    tokenizer = build_tokenizer()
    config_class, fields = MODELS[name]
    args = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                sliding_window=WINDOW, max_position_embeddings=256, initializer_range=0.2,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, **fields)
    config = getattr(transformers, config_class)(**{**args, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name == "model.norm.weight":
                param.normal_(20.0, 3.0)  # logits of several units, which a cap of 3 bends
            elif "norm" in param_name:
                param.normal_(0, 0.3)
            elif "embed_tokens" in param_name:
                param.mul_(0.05)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def gemma_models(tmp_path_factory):
    cache = {}

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = build_tiny_gemma(tmp_path_factory.mktemp(name), name)
        return cache[name]

    return get


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS]


def _variant(folder: str, tmp_path, change) -> str:
    """A copy of `folder` (weights linked) whose config.json `change` edited in place."""
    out = tmp_path / f"variant{len(list(tmp_path.iterdir()))}"
    out.mkdir()
    for f in os.listdir(folder):
        if f != "config.json":
            os.symlink(os.path.join(folder, f), out / f)
    config = json.load(open(os.path.join(folder, "config.json")))
    change(config)
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


@pytest.mark.parametrize("name, backend", [("gemma2", "cpu"), ("gemma3", "cpu"), ("gemma2", "torch"),
                                           ("gemma3", "torch"),
                                           pytest.param("gemma2", "triton", marks=pytest.mark.slow)])
def test_greedy_matches_transformers(name, backend, gemma_models):
    """16-token chunks (each prompt's prefill crosses the window's edge mid-chunk), 8 blocks of 16 that
    cannot hold every prompt (preemption), then the longest prompt's first 64 tokens again (a prefix-cache
    hit: the window layers read cached keys), each against transformers. The context is the model's, not
    the window (the kernels mask it), and the one-C++-call CPU path is not taken."""
    path = gemma_models(name)
    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=8, block_size=16, max_num_batched_tokens=16,
              max_model_len=128, seed=0, attention_backend=backend)
    assert llm.engine.runner.max_model_len == 128
    assert getattr(llm.engine.runner.model.model, "fused_layers", None) is None
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["num_chunked_prefills"] > 0 and stats["num_preemptions"] > 0
    again = prompts[-1][:64] + [7, 11, 13]
    hits = stats["prefix_cache_hits"]
    outs += llm.generate([again], params, use_tqdm=False)
    assert llm.engine.stats()["prefix_cache_hits"] - hits >= 64, "the repeated prefix must come from the cache"
    for prompt, out in zip(prompts + [again], outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"


def _no_window(c):
    c["sliding_window"] = 4096


def _gemma3_one_rope(c):
    c["rope_parameters"]["sliding_attention"] = dict(c["rope_parameters"]["full_attention"])


def _gemma3_unscaled(c):
    c["rope_parameters"]["full_attention"] = {"rope_type": "default", "rope_theta": 1000000.0}


@pytest.mark.parametrize("name, change", [
    ("gemma2", lambda c: c.update(attn_logit_softcapping=None)),
    ("gemma2", _no_window),
    ("gemma2", lambda c: c.update(query_pre_attn_scalar=16)),
    ("gemma3", _no_window),
    ("gemma3", _gemma3_one_rope),
    ("gemma3", _gemma3_unscaled),
], ids=["gemma2-attn-softcap", "gemma2-window", "gemma2-scale", "gemma3-window", "gemma3-local-rope",
        "gemma3-rope-scaling"])
def test_each_feature_changes_transformers_greedy_tokens(name, change, gemma_models, tmp_path):
    """Without the feature transformers' own greedy tokens differ on the parity test's prompts: an engine
    leaving it out would fail test_greedy_matches_transformers."""
    path = gemma_models(name)
    without = _variant(path, tmp_path, change)
    prompts = _prompts()
    assert any(hf_greedy(path, p, MAX_TOKENS) != hf_greedy(without, p, MAX_TOKENS) for p in prompts)


def test_final_logit_softcap_in_the_logprobs(gemma_models, tmp_path):
    """Soft-capping the logits keeps their order, so greedy tokens cannot show it: each chosen token's
    logprob is transformers' (capped at 3.0), and far from the uncapped model's."""
    path = gemma_models("gemma2")
    uncapped = _variant(path, tmp_path, lambda c: c.update(final_logit_softcapping=None))
    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=16, block_size=16, max_model_len=256)
    prompt = _prompts()[2]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    seq = prompt + out.token_ids
    for ref_path, close in ((path, True), (uncapped, False)):
        ref = torch.log_softmax(hf_logits(ref_path, seq)[len(prompt) - 1:-1], dim=-1)
        gaps = [abs(lp[t] - float(ref[i, t])) for i, (t, lp) in enumerate(zip(out.token_ids, out.logprobs))]
        assert (max(gaps) < 1e-4) if close else (min(gaps) > 0.1), gaps


@pytest.mark.parametrize("config", [
    # google/gemma-2-2b-it's config.json (the fields the check reads)
    {"model_type": "gemma2", "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "sliding_window": 4096,
     "query_pre_attn_scalar": 256},
    # google/gemma-3-1b-it's, as transformers 4.x saved it, and transformers 5's form of the same
    {"model_type": "gemma3_text", "attn_logit_softcapping": None, "final_logit_softcapping": None,
     "rope_scaling": None, "rope_local_base_freq": 10000, "rope_theta": 1000000, "sliding_window_pattern": 6},
    {"model_type": "gemma3_text", "layer_types": ["sliding_attention", "full_attention"],
     "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}},
    # google/gemma-3-4b-it's (multimodal): its text_config is what is checked and served
    {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "rope_scaling": {"factor": 8.0,
                                                                                          "rope_type": "linear"}},
     "vision_config": {"model_type": "siglip_vision_model"}},
])
def test_gemma_configs_pass_the_support_check(config):
    check_supported(config)


@pytest.mark.parametrize("config, refused", [
    # transformers' Gemma 3 attention never reads attn_logit_softcapping: serving it either way could be wrong
    ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}, "attention-logit soft-capping"),
    ({"model_type": "gemma3_text", "rope_parameters": {"sliding_attention": {"rope_type": "default"},
                                                       "full_attention": {"rope_type": "made-up"}}},
     "rope_scaling of type 'made-up'"),
    ({"model_type": "gemma2", "layer_types": ["sliding_attention", "chunked_attention"]},
     r"layer types \['chunked_attention'\]"),
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "bidirectional attention"),
    ({"model_type": "llama", "final_logit_softcapping": 30.0}, "final-logit soft-capping"),
    ({"model_type": "gemma3", "text_config": {"rope_scaling": {"rope_type": "made-up"}}},
     "model_type 'gemma3_text' with rope_scaling of type 'made-up'"),
])
def test_what_gemma_does_not_compute_stays_refused(config, refused):
    with pytest.raises(UnsupportedModelError, match=refused):
        check_supported(config)


def test_transformers_4_gemma3_fields_give_each_layer_type_its_rotary():
    """A Gemma 3 config as transformers 4.x reads it (rope_local_base_freq, rope_scaling, a window pattern, no
    layer_types) gives the layer types and tables transformers 5 reads from layer_types and rope_parameters."""
    from types import SimpleNamespace

    from engine.layers.rotary import rope_settings
    from engine.models.gemma import layer_types, rope_config

    old = SimpleNamespace(model_type="gemma3_text", num_hidden_layers=7, sliding_window_pattern=3, rope_theta=1e6,
                          rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                          max_position_embeddings=64)
    assert layer_types(old) == ["sliding_attention", "sliding_attention", "full_attention"] * 2 + ["sliding_attention"]
    local, full = (rope_settings(rope_config(old, kind)) for kind in ("sliding_attention", "full_attention"))
    assert (local[0], local[1]["rope_type"]) == (1e4, "default")
    assert (full[0], full[1]["rope_type"], full[1]["factor"]) == (1e6, "linear", 8.0)


def _write_gemma_gguf(path, folder: str, arch: str, kind: str = "F32") -> None:
    """A Gemma folder as llama.cpp's converter writes it (convert_hf_to_gguf.py, Gemma2Model / Gemma3Model):
    the caps and the window as metadata, no query scale (llama.cpp derives it), Gemma 3's global rotary
    base and linear factor, every norm's weight stored + 1, no lm_head (tied). The window layers are
    written as a per-layer pattern (sliding_window_pattern), as newer converters write it."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(folder)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    else:
        full = c.rope_parameters["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
        w.add_sliding_window_pattern([kind == "sliding_attention" for kind in c.layer_types])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    for hf_name, t in load_file(f"{folder}/model.safetensors").items():
        if hf_name == "lm_head.weight":
            continue
        base, suffix = hf_name.rsplit(".", 1)
        data = np.ascontiguousarray(t.numpy() + 1 if base.endswith("norm") else t.numpy())
        if kind == "Q8_0" and data.ndim == 2:
            w.add_tensor(f"{names.get_name(base)}.{suffix}", gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(f"{names.get_name(base)}.{suffix}", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name, kind", [("gemma2", "F32"), ("gemma3", "F32"), ("gemma2", "Q8_0")])
def test_gguf_serves_the_checkpoint_it_came_from(name, kind, tmp_path):
    """A GGUF written from a checkpoint (whose query scale is 1/sqrt(head_dim), as llama.cpp takes it for
    every size but 27B) serves transformers' greedy tokens: as float, for that checkpoint; as Q8_0 blocks
    (the tied embedding too, its rows scaled after they are looked up, its blocks the head's), for the
    checkpoint holding the blocks' dequantized values."""
    import gguf
    from safetensors.torch import load_file, save_file

    folder = build_tiny_gemma(tmp_path / "hf", name, seed=1, query_pre_attn_scalar=16)
    path = tmp_path / f"{name}.gguf"
    _write_gemma_gguf(path, folder, name, kind)
    if kind == "Q8_0":
        tensors = load_file(f"{folder}/model.safetensors")
        for key, t in tensors.items():
            if t.dim() == 2:
                q8 = gguf.quants.quantize(t.numpy(), gguf.GGMLQuantizationType.Q8_0)
                tensors[key] = torch.from_numpy(gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0).copy())
        save_file(tensors, f"{folder}/model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(path), tokenizer=folder, device="cpu", dtype="float32", num_kv_blocks=16, block_size=16,
              max_model_len=128, max_num_batched_tokens=16, cpu_gguf_activations="float")
    embedding = llm.engine.runner.model.model.embed_tokens
    assert getattr(embedding.quant_format, "name", "float") == ("float" if kind == "F32" else kind)
    assert llm.engine.runner.hf_config.model_type == {"gemma2": "gemma2", "gemma3": "gemma3_text"}[name]
    prompts = _prompts(1)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(folder, p, MAX_TOKENS) for p in prompts]


def test_a_multimodal_gemma3_checkpoint_serves_its_language_model(tmp_path):
    """A Gemma3ForConditionalGeneration folder (model_type "gemma3", a tiny vision tower beside the text
    model): its text_config is served and its language model's tensors load, the vision tower's are skipped;
    greedy tokens are transformers' for text-only prompts on that checkpoint."""
    import transformers

    text = build_tiny_gemma(tmp_path / "text", "gemma3")
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=transformers.AutoConfig.from_pretrained(text).to_dict(),
                                       vision_config=vision.to_dict(), mm_tokens_per_image=4, image_token_index=500,
                                       boi_token_index=498, eoi_token_index=499)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    language = transformers.AutoModelForCausalLM.from_pretrained(text, dtype=torch.float32)
    model.model.language_model.load_state_dict(language.model.state_dict())
    path = tmp_path / "multimodal"
    model.save_pretrained(path)
    shutil.copy(os.path.join(text, "tokenizer.json"), path)
    shutil.copy(os.path.join(text, "tokenizer_config.json"), path)
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=16, block_size=16, max_model_len=128)
    assert llm.engine.runner.hf_config.model_type == "gemma3_text"
    prompts = _prompts()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(str(path), p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize("name", ["model.language_model.layers.0.mlp.up_proj.weight",  # transformers 5
                                  "language_model.model.layers.0.mlp.up_proj.weight"])  # 4.x
def test_both_multimodal_layouts_name_the_language_models_tensors(name, gemma_models):
    from engine.loading.loader import resolve_model
    from engine.models.registry import model_class

    cfg = resolve_model(gemma_models("gemma3")).hf_config
    model = model_class(cfg.model_type)(cfg, max_positions=16)
    assert model.checkpoint_target(name) == ("model.layers.0.mlp.gate_up_proj.weight", 1)
    assert model.checkpoint_target("language_model.lm_head.weight") == ("lm_head.weight", None)


@pytest.mark.slow  # two rank processes
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)], ids=["tp2", "pp2"])
def test_parallel_ranks_match_transformers(layout, gemma_models):
    """TP 2 (gloo on the CPU): each rank's query and KV heads with their window and cap, its share of the
    GeGLU MLP. PP 2: each stage's layers with their rotary tables, the scaled embedding on the first, the
    final norm, soft-capped logits and the tied head on the last."""
    path = gemma_models("gemma2")
    prompts = _prompts()
    with LLM(path, device="cpu", dtype="float32", num_kv_blocks=32, block_size=16, max_model_len=128, num_threads=1,
             seed=0, **layout) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_bfloat16_first_tokens_match_transformers_in_bfloat16(name, gemma_models):
    """In bfloat16 the norms multiply by their float32 (1 + w) before rounding, and the embeddings' scale is
    rounded to bfloat16 first, as transformers does: first tokens and logprobs agree up to 16-bit noise."""
    from transformers import AutoModelForCausalLM

    from tests.engine.hf_oracle import assert_first_tokens_close

    path = gemma_models(name)
    llm = LLM(path, device="cpu", dtype="bfloat16", num_kv_blocks=16, block_size=16, max_model_len=128)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    assert_first_tokens_close(llm, model, _prompts(2) + _prompts(3))
