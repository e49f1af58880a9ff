"""Rope scaling types (engine/layers/rotary.py) against transformers: each type's frequencies and attention
factor against transformers' own functions, and greedy generation token for token on a tiny Llama whose
prompts run past the original length (32 tokens here), chunked, preempted and with a prefix-cache hit."""

from __future__ import annotations

import os
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.rotary import RotaryEmbedding, inverse_frequencies, rope_settings
from tests.engine.hf_oracle import hf_greedy
from tests.tiny_model import build_tiny_model

if not torch.cuda.is_available():
    # The triton case runs its kernels under Triton's interpreter, as tests/kernels does; the choice is
    # read when kernels/triton_*.py are first imported (the engine imports them lazily).
    os.environ.setdefault("TRITON_INTERPRET", "1")

ORIGINAL = 32  # the original (pre-training) length of every scaled config here
MAX_LEN = 128  # max_position_embeddings: 4x the original
HALF = 8  # head_dim 16 / 2: one factor per rotated pair
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": ORIGINAL,
            "short_factor": [1.0 + 0.05 * i for i in range(HALF)], "long_factor": [1.5 + 0.4 * i for i in range(HALF)]}
SCALINGS = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    # DeepSeek-V3's form: mscale / mscale_all_dim set the temperature; other betas, no truncation.
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "mscale": 0.8,
                    "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "longrope": LONGROPE,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
}


def _config(scaling: dict, max_len: int = MAX_LEN):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=max_len,
                       rope_parameters={**scaling, "rope_theta": 10000.0})


@pytest.mark.parametrize("name", sorted(SCALINGS))
@pytest.mark.parametrize("length", [None, 100, 300])
def test_frequencies_and_attention_factor_are_transformers(name, length):
    """For a length-dependent type `length` is the length transformers computes for, and the table's
    length here; None is each one's unscaled start (transformers' init)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _config(SCALINGS[name])
    want, want_attention = ROPE_INIT_FUNCTIONS[SCALINGS[name]["rope_type"]](config, None, seq_len=length)
    theta, scaling = rope_settings(config)
    got, attention = inverse_frequencies(16, theta, scaling, length)
    torch.testing.assert_close(got, want.double(), rtol=1e-6, atol=0)
    assert attention == pytest.approx(want_attention, rel=1e-12)


def test_dynamic_ntk_base_follows_the_formula_for_the_served_length():
    """Past max_position_embeddings (64) the base grows as the NTK-aware formula says for the table's
    length (bloc97/emozilla, as transformers writes it):
    theta * (factor * L / trained - (factor - 1)) ** (d / (d - 2))."""
    theta, scaling = rope_settings(_config(SCALINGS["dynamic"], max_len=64))
    for length in (64, 200):
        base = 10000.0 * (2.0 * length / 64 - 1.0) ** (16 / 14)
        want = 1.0 / base ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
        torch.testing.assert_close(inverse_frequencies(16, theta, scaling, length)[0], want)
        table = RotaryEmbedding(16, length, theta, scaling)  # what the model looks up: cos of position x inv_freq
        torch.testing.assert_close(table.cos[length - 1].double(), ((length - 1) * want).cos(), rtol=0, atol=1e-6)
    assert base > 10000.0 * 5  # the 200-token table is really scaled


def test_longrope_takes_the_long_factors_when_the_table_passes_the_original_length():
    theta, scaling = rope_settings(_config(LONGROPE))
    base = 1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    short = torch.tensor(LONGROPE["short_factor"], dtype=torch.float64)
    long = torch.tensor(LONGROPE["long_factor"], dtype=torch.float64)
    torch.testing.assert_close(inverse_frequencies(16, theta, scaling, ORIGINAL)[0], base / short)
    torch.testing.assert_close(inverse_frequencies(16, theta, scaling, ORIGINAL + 1)[0], base / long)


@pytest.fixture(scope="module")
def scaled_models(tmp_path_factory):
    cache = {}

    def get(name: str) -> str:
        if name not in cache:
            # dynamic's trained length is max_position_embeddings itself: its sequences stay within it.
            cache[name] = build_tiny_model(tmp_path_factory.mktemp(name), model_type="llama", head_dim=16,
                                           max_position_embeddings=MAX_LEN, rope_scaling=SCALINGS[name])
        return cache[name]

    return get


def _generate_and_compare(path: str, backend: str, lengths: list[int], max_tokens: int = 6) -> None:
    """Greedy tokens of prompts of these lengths (one of 100 among them), in 32-token chunks, in 8 blocks
    of 16 that cannot hold them all (preemption), then the longest prompt's first 64 tokens plus others
    again (a prefix-cache hit), each against transformers."""
    llm = LLM(path, device="cpu", num_kv_blocks=8, block_size=16, max_model_len=MAX_LEN, max_num_batched_tokens=32,
              seed=0, attention_backend=backend)
    rng = random.Random(len(path))
    prompts = [[rng.randrange(3, llm.engine.vocab_size) for _ in range(n)] for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["num_chunked_prefills"] > 0 and stats["num_preemptions"] > 0
    again = max(prompts, key=len)[:64] + [rng.randrange(3, llm.engine.vocab_size) for _ in range(9)]
    hits = llm.engine.stats()["prefix_cache_hits"]
    outs += llm.generate([again], params, use_tqdm=False)
    assert llm.engine.stats()["prefix_cache_hits"] - hits >= 64, "the repeated prefix must come from the cache"
    for prompt, out in zip(prompts + [again], outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, max_tokens), f"prompt of {len(prompt)} tokens"


# Every prompt past the original 32 tokens: transformers' LongRoPE takes its long factors for them, as the
# engine does for a table longer than the original (a shorter one takes the short factors: test_phi3.py).
LENGTHS = {"yarn": [5, 40, 100], "yarn-mscale": [40, 100], "dynamic": [5, 40, 100], "longrope": [40, 100]}


@pytest.mark.parametrize("name, backend", [(name, "cpu") for name in LENGTHS] + [
    ("yarn", "torch"), pytest.param("yarn", "triton", marks=pytest.mark.slow)])
def test_greedy_matches_transformers(name, backend, scaled_models):
    _generate_and_compare(scaled_models(name), backend, LENGTHS[name])


def test_yarn_from_gguf_metadata_matches_transformers(tmp_path, monkeypatch):
    """llama.cpp's converter writes YaRN as rope.scaling.type/factor/original_context_length (and the betas
    as yarn_beta_fast/slow): the file serves the tokens transformers computes for the checkpoint it came from."""
    import gguf
    from transformers import AutoModelForCausalLM

    from tests.test_gguf_loader import _write_gguf

    yarn = {**SCALINGS["yarn"], "beta_fast": 8.0, "beta_slow": 2.0}
    folder = build_tiny_model(tmp_path / "qwen2", model_type="qwen2", head_dim=16, max_position_embeddings=MAX_LEN,
                              rope_scaling=yarn)

    class YarnWriter(gguf.GGUFWriter):
        def add_rope_freq_base(self, value: float) -> None:
            super().add_rope_freq_base(value)
            self.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            self.add_rope_scaling_factor(4.0)
            self.add_rope_scaling_orig_ctx_len(ORIGINAL)
            self.add_rope_scaling_yarn_beta_fast(yarn["beta_fast"])
            self.add_rope_scaling_yarn_beta_slow(yarn["beta_slow"])

    monkeypatch.setattr(gguf, "GGUFWriter", YarnWriter)
    path = tmp_path / "yarn.gguf"
    _write_gguf(path, AutoModelForCausalLM.from_pretrained(folder), "qwen2")
    llm = LLM(str(path), tokenizer=folder, device="cpu", num_kv_blocks=32, max_model_len=MAX_LEN)
    prompts = [list(range(3, 60)), [5, 9, 33]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(folder, p, 6) for p in prompts]


def test_a_stretching_rope_scaling_serves_its_factor_times_the_trained_length(tmp_path):
    """As vLLM: with yarn (a static stretch) over the model's own max_position_embeddings (Qwen2.5's hub
    configs), --max-model-len may reach original x factor, token for token with transformers past the
    trained length; the default context stays max_position_embeddings, and past the stretch is refused."""
    from engine.planning.spec import position_limit

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    path = build_tiny_model(tmp_path / "yarn", model_type="llama", head_dim=16, max_position_embeddings=64,
                            rope_scaling=yarn)
    assert position_limit({"max_position_embeddings": 64, "rope_scaling": yarn}) == 256
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    assert position_limit({"max_position_embeddings": 64, "rope_scaling": dynamic}) == 128
    assert position_limit({"max_position_embeddings": 64, "rope_scaling": LONGROPE}) == 64  # states its own length
    llm = LLM(path, device="cpu", num_kv_blocks=64, block_size=16, max_model_len=256, seed=0)
    try:
        prompt = [random.Random(7).randrange(3, llm.engine.vocab_size) for _ in range(150)]
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert out[0].outputs[0].token_ids == hf_greedy(path, prompt, 8)
    finally:
        llm.shutdown()
    default = LLM(path, device="cpu", num_kv_blocks=64, block_size=16)
    try:
        assert default.engine.max_model_len == 64
    finally:
        default.shutdown()
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings \\(64, 256 with its rope"):
        LLM(path, device="cpu", num_kv_blocks=64, max_model_len=257)
