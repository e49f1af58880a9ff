"""Multi-LoRA serving against transformers + PEFT generating each adapter alone: one batch of the
base model and three adapters of different ranks, targets and scalings (rsLoRA among them), fewer
slots than adapters (the scheduler holds a step to max_loras and slots are refilled), the prefix
cache warm with the base model's blocks of the same prompts (an adapter must never read them), on
the torch and C++ backends, under tensor parallelism (gloo) and on a GGUF base."""

from __future__ import annotations

import pytest

from engine import LLM, LoRARequest, SamplingParams

from tests.engine.lora_adapters import build_adapter, peft_greedy
from tests.tiny_model import build_tiny_model

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 17, 33, 9, 100, 41, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 40], [3, 4, 5, 6],
           list(range(200, 237))]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_model(root / "base", model_type="llama", num_attention_heads=4, num_key_value_heads=2)
    adapters = [
        LoRARequest("attn-r8", 1, build_adapter(base, root / "a1", 8, ATTENTION, seed=1)),
        LoRARequest("all-r3-rs", 2, build_adapter(base, root / "a2", 3, ATTENTION + MLP, use_rslora=True, seed=2)),
        LoRARequest("mlp-r16", 3, build_adapter(base, root / "a3", 16, MLP, alpha=8, seed=3)),
    ]
    return base, adapters


def expected(base: str, loras: list[LoRARequest | None]) -> list[list[int]]:
    return [peft_greedy(base, lora.lora_path if lora else None, p, MAX_TOKENS) for p in PROMPTS for lora in loras]


def mixed(llm: LLM, loras: list[LoRARequest | None]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([p for p in PROMPTS for _ in loras], params, use_tqdm=False,
                        lora_request=[lora for _ in PROMPTS for lora in loras])
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_a_mixed_batch_equals_peft_generating_each_adapter_alone(lora_models, backend):
    base, adapters = lora_models
    loras = [None, *adapters]
    want = expected(base, loras)
    assert len({tuple(w) for w in want[:len(loras)]}) == len(loras), "each adapter must change the output"
    llm = LLM(base, device="cpu", dtype="float32", attention_backend=backend, enable_lora=True, max_loras=2,
              max_lora_rank=16, num_kv_blocks=128, block_size=8)
    try:
        mixed(llm, [None])  # the base model's blocks of these prompts are now in the prefix cache
        fused = llm.engine.runner.model.model.fused_layers  # cpu: small steps run the layers in one C++ call
        before = fused.steps if fused is not None else 0
        assert mixed(llm, loras) == want
        assert mixed(llm, list(reversed(loras))) == expected(base, list(reversed(loras)))  # slots refilled
        assert backend != "cpu" or fused.steps > before, "adapter steps must take the fused C++ layers too"
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_tensor_parallel_splits_adapters_as_it_splits_the_base_weights(lora_models):
    base, adapters = lora_models
    loras = [None, *adapters]
    llm = LLM(base, device="cpu", dtype="float32", tensor_parallel_size=2, enable_lora=True, max_loras=4,
              max_lora_rank=16, num_kv_blocks=128, num_threads=1)
    try:
        assert mixed(llm, loras) == expected(base, loras)
    finally:
        llm.shutdown()


def test_a_gguf_base_serves_the_adapters_of_its_checkpoint(lora_models, tmp_path):
    from tests.engine.quant.test_gguf_native import write_gguf

    base, adapters = lora_models
    gguf_path = tmp_path / "base.gguf"
    write_gguf(gguf_path, base, "llama", None)  # float32 matrices: the same model as the folder's
    loras = [None, adapters[1]]
    llm = LLM(str(gguf_path), tokenizer=base, device="cpu", dtype="float32", enable_lora=True, max_lora_rank=16,
              num_kv_blocks=128)
    try:
        assert mixed(llm, loras) == expected(base, loras)
    finally:
        llm.shutdown()


def test_the_scheduler_runs_at_most_max_loras_adapters_a_step_and_lets_base_requests_pass(lora_models):
    from engine.config import EngineConfig
    from engine.core.kv_cache import KVCacheManager
    from engine.core.scheduler import Scheduler
    from engine.request import Request

    _, adapters = lora_models
    config = EngineConfig(enable_lora=True, max_loras=1, max_num_batched_tokens=256)
    scheduler = Scheduler(config, KVCacheManager(64, 16, True), 512)
    params = SamplingParams(max_tokens=4)
    order = [adapters[0], adapters[1], None, adapters[1], adapters[0], None]
    for i, lora in enumerate(order):
        scheduler.add(Request(str(i), [7, 8, 9], params, lora_request=lora))
    out = scheduler.schedule()
    started = [key.partition("#")[0] for key, _ in out.num_scheduled_tokens]
    # Adapter 1 holds the one slot; adapter 2's requests wait, the base ones behind them start.
    assert started == ["0", "2", "4", "5"]
    assert [r.request_id for r in scheduler.waiting] == ["1", "3"]
    assert scheduler.num_waiting == 2


def test_a_bad_adapter_is_refused_in_one_line_naming_lora_request(lora_models, tmp_path):
    from engine.sampling_params import RequestError

    base, adapters = lora_models
    dora = build_adapter(base, tmp_path / "dora", 4, ["q_proj"], use_dora=True)
    wide = build_adapter(base, tmp_path / "wide", 32, ["q_proj"])
    embed = build_adapter(base, tmp_path / "embed", 4, ["embed_tokens"])
    other = build_adapter(build_tiny_model(tmp_path / "other", hidden_size=96), tmp_path / "foreign", 4, ["q_proj"])
    llm = LLM(base, device="cpu", enable_lora=True, max_lora_rank=16, num_kv_blocks=32)
    cases = [(dora, "DoRA"), (wide, "exceeds max_lora_rank 16"), (embed, "not a LoRA A or B matrix"),
             (other, "another base model"), (str(tmp_path / "missing"), "no such folder")]
    try:
        for i, (path, why) in enumerate(cases):
            with pytest.raises(RequestError, match=why) as caught:
                llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False,
                             lora_request=LoRARequest(f"bad{i}", 10 + i, path))
            assert caught.value.field == "lora_request" and "\n" not in str(caught.value)
        # Nothing was left behind: the engine serves the base model and a good adapter as before.
        outs = llm.generate([[5, 6, 7]] * 2, SamplingParams(max_tokens=2), use_tqdm=False,
                            lora_request=[None, adapters[0]])
        assert all(len(o.outputs[0].token_ids) == 2 for o in outs)
        assert llm.engine.stats()["num_used_blocks"] == 0
    finally:
        llm.shutdown()
    with pytest.raises(RequestError, match="LoRA serving is off"):
        plain = LLM(base, device="cpu", num_kv_blocks=32)
        try:
            plain.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False, lora_request=adapters[0])
        finally:
            plain.shutdown()


def test_a_mixture_of_experts_model_serves_attention_adapters_and_refuses_expert_ones(tmp_path):
    from engine.sampling_params import RequestError
    from tests.engine.conftest import FAMILIES

    base = build_tiny_model(tmp_path / "mixtral", **FAMILIES["mixtral"])
    attention = LoRARequest("attn", 1, build_adapter(base, tmp_path / "attn", 8, ATTENTION, seed=4))
    experts = LoRARequest("experts", 2, build_adapter(base, tmp_path / "experts", 8, ["w1", "w2", "w3"], seed=5))
    llm = LLM(base, device="cpu", dtype="float32", enable_lora=True, max_lora_rank=16, num_kv_blocks=128)
    try:
        assert mixed(llm, [None, attention]) == expected(base, [None, attention])
        with pytest.raises(RequestError, match="is not a target this model serves|not supported"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False, lora_request=experts)
    finally:
        llm.shutdown()


def test_the_adapter_slots_take_what_the_planner_counts(lora_models):
    from engine.planning import ModelSpec
    from engine.planning.lora import adapter_slot_bytes
    from transformers import AutoConfig

    base, _ = lora_models
    llm = LLM(base, device="cpu", dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8, num_kv_blocks=32)
    try:
        held = sum(m.lora.nbytes for m in llm.engine.runner.adapters.layers.values())
    finally:
        llm.shutdown()
    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(base).to_dict())
    assert held == adapter_slot_bytes(spec, 3, 8, 4)


def test_adapters_under_preemption_and_prompt_lookup_speculation(lora_models):
    """A pool too small for the batch preempts and recomputes adapter requests; n-gram speculation
    verifies drafts through each request's adapter. Both keep PEFT's tokens."""
    base, adapters = lora_models
    loras = [None, *adapters]
    repeated = [[40, 41, 42, 43] * 6]  # a pattern the prompt-lookup proposer drafts from
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    small = LLM(base, device="cpu", dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16,
                num_kv_blocks=12, block_size=8, max_num_batched_tokens=32)
    try:
        outs = small.generate([p for p in PROMPTS for _ in loras], params, use_tqdm=False,
                              lora_request=[lora for _ in PROMPTS for lora in loras])
        assert small.engine.stats()["num_preemptions"] > 0
        assert [o.outputs[0].token_ids for o in outs] == expected(base, loras)
    finally:
        small.shutdown()
    speculating = LLM(base, device="cpu", dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16,
                      num_kv_blocks=128, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                             "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    try:
        outs = speculating.generate(repeated * len(loras), params, use_tqdm=False, lora_request=loras)
        assert speculating.engine.stats()["num_draft_tokens"] > 0
        assert [o.outputs[0].token_ids for o in outs] == [peft_greedy(base, lora.lora_path if lora else None,
                                                                       repeated[0], MAX_TOKENS) for lora in loras]
    finally:
        speculating.shutdown()


def test_an_adapter_folder_gone_after_admission_fails_its_request_alone(lora_models, tmp_path):
    import shutil

    base, adapters = lora_models
    doomed = LoRARequest("doomed", 9, shutil.copytree(adapters[0].lora_path, tmp_path / "doomed"))
    llm = LLM(base, device="cpu", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=64)
    core = llm.engine
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        core.check_request(PROMPTS[0], params, doomed)  # admitted: the folder is there
        shutil.rmtree(doomed.lora_path)
        core.add_request("gone", PROMPTS[0], params, lora_request=doomed)
        core.add_request("base", PROMPTS[1], params)
        outputs = []
        while core.has_unfinished_requests():
            outputs += core.step()
        failed = [o for o in outputs if o.request_id == "gone"]
        assert failed and failed[-1].invalid_request and "no such folder" in failed[-1].error
        base_tokens = [t for o in outputs if o.request_id == "base" for t in o.new_token_ids]
        assert base_tokens == peft_greedy(base, None, PROMPTS[1], 4)
        assert core.stats()["num_used_blocks"] == 0
    finally:
        llm.shutdown()
