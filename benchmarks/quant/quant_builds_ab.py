"""Whole decode steps (batch 1, or --batch N) with kernels/cpu_quant.cpp (or, --library ops, kernels/cpu_ops.cpp) as
of another commit against the working tree's, in one process (this machine's speed moves 20-40%
within minutes, so separate processes cannot rank a few percent): the fused decode layers call one
build's matmuls, and kernels/cpu_quant.py's calls (the LM head, the layers of steps too big for the
fused path: --batch above 16) go to the same build (or, --library ops, the fused layers run one build's
DecoderLayers, attention and norms included), alternating by round; the tokens must be the same.

    python benchmarks/quant/quant_builds_ab.py COMMIT [--library quant|ops] [--model FILE] [--rounds 10]
        [--prompt-len 128] [--new-tokens 128] [--batch 1]
"""

from __future__ import annotations

import argparse
import inspect
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path


def main() -> None:
    from engine.models import cpu_fused_layers
    from kernels import cpu_build, cpu_quant

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("commit")
    p.add_argument("--model", default=None, help="default: the default model's Q4_1 file")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128, help="the prompt's tokens: the context decode starts from")
    p.add_argument("--batch", type=int, default=1, help="requests decoded together (the rows of a decode step)")
    p.add_argument("--library", choices=["quant", "ops"], default="quant",
                   help="which C++ library the arms differ in: cpu_quant.cpp's matmuls, or cpu_ops.cpp's "
                        "DecoderLayers and the kernels around the matmuls")
    args = p.parse_args()
    source = subprocess.run(["git", "show", f"{args.commit}:kernels/cpu_{args.library}.cpp"], check=True,
                            capture_output=True, text=True).stdout
    if args.library == "ops":  # two builds of one module in a process: their pybind classes stay module-local
        source = re.sub(r'pybind11::class_<(\w+)>\(m, "(\w+)"\)',
                        r'pybind11::class_<\1>(m, "\2", pybind11::module_local())', source)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"cpu_{args.library}.cpp"
        path.write_text(source)
        old = cpu_build._build(path, f"pagewise_cpu_{args.library}_ab")
    if args.library == "ops":
        run_ops_builds(args, {"old": old, "new": cpu_build.load()})
        return
    builds = {"old": old, "new": cpu_build.load_quant()}
    chosen = {"build": builds["new"]}
    # The fused layers take their matmuls' addresses from _linear_kernels when they bind: replacing
    # it is what makes the two arms differ (a renamed hook would silently compare a build with itself,
    # so the old one is read first and a rename fails here).
    row_limits = cpu_fused_layers._linear_kernels()[3:]
    cpu_fused_layers._linear_kernels = lambda: (chosen["build"].linear_f32_address(),
                                                chosen["build"].linear_q8_address(),
                                                chosen["build"].linear_q16_address(), *row_limits)
    assert builds["old"].linear_f32_address() != builds["new"].linear_f32_address()
    cpu_quant.load_quant = lambda: chosen["build"]  # the module-level calls: the head, bigger steps
    alternate(args, builds, lambda build: chosen.update(build=build))


def run_ops_builds(args, builds: dict) -> None:
    """The arms differ in cpu_ops.cpp: the fused layers bind to one build's DecoderLayers or the other's."""
    from engine.models import cpu_fused_layers
    from kernels import cpu_build

    # _bind makes its DecoderLayers from cpu_build.load(): replacing that is what makes the arms
    # differ (if _bind stopped reading it, the arms would silently be one build: fail here instead).
    assert "cpu_build.load().DecoderLayers" in inspect.getsource(cpu_fused_layers.CpuFusedLayers._bind)
    quant = cpu_build.load_quant()
    builds["old"].use_pool(quant.parallel_for_address(), quant.helpers_address())  # as cpu_build does the new
    chosen = {"build": builds["new"]}
    cpu_build.load = lambda: chosen["build"]
    alternate(args, builds, lambda build: chosen.update(build=build))


def alternate(args, builds: dict, choose) -> None:
    """Rounds of one greedy request, the arms alternating (choose(build) switches); decode tok/s each."""
    from engine import LLM, SamplingParams
    from engine.loading.default_model import default_gguf_path

    assert builds["old"] is not builds["new"]
    # No prefix cache: a repeated prompt would skip its prefill, and a 16-bit model's tokens can then
    # differ from the first run's (the cached keys came from the prompt's many-row kernels).
    llm = LLM(model=args.model or default_gguf_path(), num_threads=2, enable_prefix_caching=False)
    fused = llm.engine.runner.model.model.fused_layers
    steps: list[float] = []
    step = llm.engine.step

    def timed_step(*a, **k):
        start = time.perf_counter()
        out = step(*a, **k)
        steps.append(time.perf_counter() - start)
        return out

    llm.engine.step = timed_step
    prompt = [100 + i % 20000 for i in range(args.prompt_len)]
    params = SamplingParams(max_tokens=args.new_tokens + 1, temperature=0, ignore_eos=True)
    tok_s: dict[str, list[float]] = {"old": [], "new": []}
    tokens = {}
    for r in range(args.rounds):
        for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
            choose(builds[name])
            fused._bound_to = None  # bind again, to this build's matmuls
            steps.clear()
            outs = llm.generate([prompt] * args.batch, params, use_tqdm=False)
            out = [o.outputs[0].token_ids for o in outs]
            assert tokens.setdefault(name, out) == out
            # decode steps: the median (the first, or first few at a batch, prefill)
            tok_s[name].append(args.batch / statistics.median(steps[1:]))
        print(f"round {r}: {args.commit} {tok_s['old'][-1]:.1f}, working tree {tok_s['new'][-1]:.1f} tok/s, "
              f"load {open('/proc/loadavg').read().split()[0]}", flush=True)
    ratio = statistics.median(n / o for n, o in zip(tok_s["new"], tok_s["old"]))
    print(f"median ratio working tree / {args.commit}: {ratio:.3f}; same tokens: {tokens['old'] == tokens['new']}")
    llm.shutdown()


if __name__ == "__main__":
    main()
