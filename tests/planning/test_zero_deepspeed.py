"""`--zero-accounting deepspeed` against DeepSpeed's own estimators.

DeepSpeed ships `estimate_zero2_model_states_mem_needs` (deepspeed/runtime/zero/stage_1_and_2.py) and
`estimate_zero3_model_states_mem_needs` (stage3.py); they are called here when deepspeed imports (it installs
from its sdist on a CPU machine in under a minute, no ops built). Without it, the same two functions'
published formulas are used, transcribed from deepspeedai/DeepSpeed (checked against v0.19.8):
  ZeRO-2, no offload: 2Ψ + 18Ψ/N   (18 = 16-bit grads 2 + fp32 grads 4 + fp32 params 4 + Adam states 8)
  ZeRO-3, no offload: 4 x largest_layer_params + 18Ψ/N
where largest_layer_params is the largest module's own parameters (DeepSpeed's `model_to_params`).
"""

import pytest

from engine.planning.memory import model_state_memory
from engine.planning.spec import ModelSpec

try:
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as zero3
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as zero2
except Exception:  # not installed (or no usable accelerator stub): the published formulas
    def zero2(total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True, additional_buffer_factor=1.5):
        return 0, 2 * total_params + int(18 * total_params / (num_nodes * num_gpus_per_node))

    def zero3(total_params, largest_layer_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True,
              cpu_offload_params=True, zero_init=True, additional_buffer_factor=1.5):
        largest = 4 * largest_layer_params
        return 0, largest + int(18 * total_params / (num_nodes * num_gpus_per_node)), largest


def largest_layer_params_of_the_real_model(name):
    """DeepSpeed's rule on the Hugging Face module tree, built on the meta device (no memory)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from engine.planning.presets import PRESETS

    config = transformers.LlamaConfig(**{k: v for k, v in PRESETS[name].items() if k != "model_type"})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest


@pytest.mark.parametrize("name", ["llama-2-7b", "llama-3-70b"])
@pytest.mark.parametrize("nodes", [1, 8])
@pytest.mark.parametrize("zero", [2, 3])
def test_deepspeed_accounting_matches_deepspeed_estimators_within_1_percent(name, nodes, zero):
    spec = ModelSpec.from_preset(name)
    total, largest = largest_layer_params_of_the_real_model(name)
    assert spec.params == total and spec.largest_module_params() == largest
    gpus = 8 * nodes
    if zero == 2:
        _, published = zero2(total, num_gpus_per_node=8, num_nodes=nodes, cpu_offload=False)
    else:
        _, published, _ = zero3(total, largest, num_gpus_per_node=8, num_nodes=nodes, cpu_offload=False,
                                cpu_offload_params=False)
    states = model_state_memory(spec, dp=gpus, zero=zero, accounting="deepspeed")
    ours = states.weights + states.gradients + states.optimizer
    assert ours == pytest.approx(published, rel=0.01)
    paper = model_state_memory(spec, dp=gpus, zero=zero)
    assert ours > paper.weights + paper.gradients + paper.optimizer  # the paper's figure is optimistic



def test_cli_flag_switches_the_accounting():
    import json
    import subprocess
    import sys

    def total(*extra):
        done = subprocess.run([sys.executable, "-m", "engine.planning.cli", "train", "--model", "llama-2-7b",
                               "--seq-len", "4096", "--tokens", "1e9", "--gpus-per-node", "8", "--zero", "3",
                               "--json", *extra], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        memory = json.loads(done.stdout)["memory_per_gpu"]
        return memory["weights"] + memory["gradients"] + memory["optimizer"]

    assert total("--zero-accounting", "deepspeed") > total() == total("--zero-accounting", "paper")
