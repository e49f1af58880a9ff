"""LoRA's activations against what autograd keeps: a tiny Llama wrapped by PEFT, one forward on CPU.

The base is frozen, so autograd keeps no tensor that only a frozen weight's gradient needs; the count
(activations.py) must equal the saved tensors (counted with saved_tensors_hooks, each storage once,
parameters excluded) to within the loss's 4-byte scalar, as tests/planning/test_measured.py requires of
full fine-tuning. The embedding output requires a gradient, as `enable_input_require_grads` sets it.
"""

import peft
import pytest
import torch
import transformers

from engine.planning.activations import activation_memory
from engine.planning.lora import LORA_TARGETS, LoraSpec
from engine.planning.spec import ModelSpec
from tests.planning.test_measured import BATCH, SEQ, VOCAB, saved_bytes_of_forward

TARGETS = [("q", "v"), ("o", "down"), LORA_TARGETS]
KERNEL = {"eager": "eager", "sdpa": "flash"}


def lora_llama(attn, targets, dropout, dtype=torch.float32, recompute="none"):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=SEQ, attn_implementation=attn, use_cache=False,
    )).to(dtype)
    if recompute == "full":
        model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    config = peft.LoraConfig(r=4, target_modules=[f"{t}_proj" for t in targets], lora_dropout=dropout)
    wrapped = peft.get_peft_model(model, config)  # float32 adapters, PEFT's default
    wrapped.train()
    return wrapped, ModelSpec.from_hf_config(model.config.to_dict())


def measure(model, autocast=False):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        measured, loss = saved_bytes_of_forward(model, ids)
    loss.backward()  # the saved tensors were usable: the count was of a real training step
    return measured


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("targets", TARGETS, ids=",".join)
@pytest.mark.parametrize("attn", KERNEL)
def test_lora_activations_equal_saved_tensors(attn, targets, dropout):
    model, spec = lora_llama(attn, targets, dropout)
    predicted = activation_memory(spec, SEQ, BATCH, 4, attention=KERNEL[attn],
                                  lora=LoraSpec(4, targets, lora_dropout=dropout)).stored
    if dropout:
        # On CPU torch's dropout keeps its mask in the input's dtype (4 bytes here); the count keeps CUDA's
        # 1-byte mask (native_dropout), so the CPU run holds 3 bytes more per element of each dropped input.
        inputs = sum(p.in_features for p in spec.projections() if p.target in targets)
        predicted += 3 * inputs * spec.num_layers * BATCH * SEQ
    assert measure(model) == pytest.approx(predicted, abs=4)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("targets", TARGETS[::2], ids=",".join)
def test_float32_adapters_under_bfloat16_autocast_keep_cast_copies(targets):
    # --dtype mixed as PEFT runs it: a bfloat16 base, float32 adapters, autocast; each A reads a 16-bit cast of
    # its input and the matmuls keep autocast's 16-bit copies of A and B.
    model, spec = lora_llama("sdpa", targets, 0.0, dtype=torch.bfloat16)
    predicted = activation_memory(spec, SEQ, BATCH, 2, lora=LoraSpec(4, targets, copies_input=True)).stored
    assert measure(model, autocast=True) == pytest.approx(predicted, abs=4)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_full_recomputation_keeps_only_layer_inputs_with_lora():
    model, spec = lora_llama("sdpa", LORA_TARGETS, 0.1, recompute="full")
    lora = LoraSpec(4, LORA_TARGETS, lora_dropout=0.1)
    predicted = activation_memory(spec, SEQ, BATCH, 4, recompute="full", lora=lora).stored
    assert measure(model) == pytest.approx(predicted, abs=4)
