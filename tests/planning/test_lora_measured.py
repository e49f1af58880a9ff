"""LoRA against real tensors on CPU: the activations of a tiny Llama wrapped by PEFT against what autograd
keeps, and the frozen base's bytes against the same model loaded quantized by bitsandbytes.

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
from engine.planning.flops import training_flops
from engine.planning.lora import LORA_TARGETS, LoraSpec, adapter_params, frozen_base_bytes
from engine.planning.memory import model_state_memory
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
    spec = ModelSpec.from_hf_config(model.config.to_dict())
    if not targets:  # full fine-tuning
        return model, spec
    config = peft.LoraConfig(r=4, target_modules=[f"{t}_proj" for t in targets], lora_dropout=dropout)
    wrapped = peft.get_peft_model(model, config)  # float32 adapters, PEFT's default
    wrapped.train()
    return wrapped, spec


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


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("quantization", [
    dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False),
    dict(load_in_8bit=True),
], ids=["nf4-double-quant", "nf4", "int8"])
def test_frozen_base_bytes_equal_bitsandbytes_storage(tmp_path, quantization):
    # The base as transformers loads it quantized by bitsandbytes (on CPU): each parameter's bytes, with a 4-bit
    # weight's absmax (and double quantization's second-level absmax) or an 8-bit weight's row scales. The
    # per-tensor code tables and offset are left out of both sides (lora.py's docstring).
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=transformers.BitsAndBytesConfig(**quantization), device_map="cpu",
        dtype=torch.bfloat16)
    stored = 0
    for p in model.parameters():
        stored += p.nbytes
        state = getattr(p, "quant_state", None)
        if state is not None:
            stored += state.absmax.nbytes + (state.state2.absmax.nbytes if state.nested else 0)
        if getattr(p, "SCB", None) is not None:
            stored += p.SCB.nbytes
    base = "int8" if quantization.get("load_in_8bit") else "nf4"
    lora = LoraSpec(4, base_quantization=base, double_quant=quantization.get("bnb_4bit_use_double_quant", True))
    assert frozen_base_bytes(ModelSpec.from_hf_config(config.to_dict()), lora, 2) == stored  # exact


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_lora_weights_gradients_and_adamw_state_are_exact():
    model, spec = lora_llama("sdpa", LORA_TARGETS, 0.0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    measure(model)
    optimizer.step()
    states = model_state_memory(spec, precision="float32", optimizer="adamw", lora=LoraSpec(4, LORA_TARGETS))
    assert states.weights == sum(p.nbytes for p in model.parameters())
    assert states.gradients == sum(p.grad.nbytes for p in trainable)
    assert states.optimizer == sum(t.nbytes for s in optimizer.state.values() for t in s.values())
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


@pytest.mark.parametrize("targets", [None, ("q", "v"), LORA_TARGETS], ids=lambda t: ",".join(t or ["full"]))
def test_training_flops_equal_torch_flop_counter(targets):
    # A frozen weight's matmul runs forward and for its input's gradient (2 of full fine-tuning's 3), an adapter's
    # all three; with eager attention torch's counter sees QK^T and PV as matmuls too.
    from torch.utils.flop_counter import FlopCounterMode

    model, spec = lora_llama("eager", targets, 0.0)
    adapters = targets and adapter_params(spec, LoraSpec(4, targets))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    assert training_flops(spec, SEQ, BATCH * SEQ, "exact", "none", adapters)[0] == counter.get_total_flops()
