"""Anatomy of a decode step: its time, tokens per second, the kernels it launches and how busy it
keeps the GPU, at a few batch sizes, with CUDA graphs on and off.

    python -m engine.bench.decode_anatomy --model DIR --batch-sizes 1,64 --context 1024 --output-json out.json

B requests of --context random prompt tokens are prefilled, then every step decodes one token for
each of them (greedy, EOS ignored). Timed: the engine core's whole step (schedule, inputs, forward,
sampling, the token ids back on the host), --steps of them, medians. Then --profile-steps more under
torch.profiler, each in a `decode_step` range:

- kernels per step: on CUDA the device's activities (kernels, copies, memsets, those a graph replays
  included); on CPU the leaf ATen ops that compute (views and allocations left out), a proxy;
- host launches per step (CUDA): kernel launches, async copies and memsets, graph launches issued
  by the host; a graph replay is one launch however many kernels it holds;
- GPU busy: the device's activity a profiled step (the union of its intervals) over the median
  unprofiled step time (CUDA);
- top kernels (CUDA): the device activities grouped by name, microseconds and launches a step.

Bytes per step = the weights (all parameters; an untied input embedding only for the B rows it
reads) plus the KV cache read (B x context x bytes per token), so GB/s = bytes / step time compares
with a measured copy bandwidth (kernels/bench.py: copy_bandwidth).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

STEP_RANGE = "decode_step"
TOP_KERNELS = 12  # kernels (by name) listed per row: where a step's device time goes
# ATen ops that only make or reshape a tensor's metadata (or allocate): no kernel, no compute.
_NO_COMPUTE = {
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::view", "aten::_reshape_alias",
    "aten::reshape", "aten::as_strided", "aten::resolve_conj", "aten::resolve_neg", "aten::detach",
    "aten::alias", "aten::t", "aten::transpose", "aten::expand", "aten::unsqueeze", "aten::squeeze",
    "aten::slice", "aten::select", "aten::permute", "aten::lift_fresh", "aten::unbind", "aten::split",
    "aten::chunk", "aten::narrow", "aten::unflatten", "aten::flatten", "aten::contiguous",
    "aten::set_", "aten::_unsafe_view", "aten::view_as", "aten::result_type", "aten::item",
    "aten::_local_scalar_dense", "aten::is_nonzero", "aten::size", "aten::stride", "aten::dim",
}
# Host calls that put work on a CUDA stream (runtime and driver spellings).
_LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                 "cudaMemcpyAsync", "cudaMemsetAsync", "cudaGraphLaunch", "cuGraphLaunch")
_GRAPH_LAUNCH = ("cudaGraphLaunch", "cuGraphLaunch")


def supports_graph_switch() -> bool:
    """Whether EngineConfig has vLLM's enforce_eager (CUDA graphs on/off)."""
    import dataclasses

    from engine.config import EngineConfig

    return any(f.name == "enforce_eager" for f in dataclasses.fields(EngineConfig))


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _computes(e) -> bool:
    return e.name.startswith("aten::") and e.name not in _NO_COMPUTE


def _innermost_compute(e) -> bool:
    """An ATen op that computes and calls no other that does (matmul -> mm: only mm counts)."""
    def below(x) -> bool:
        return any(_computes(c) or below(c) for c in x.cpu_children)

    return _computes(e) and not below(e)


def step_activity(events, num_steps: int, on_cuda: bool) -> dict:
    """Counts per step from a profile of `num_steps` steps each inside a `decode_step` range."""
    from torch.autograd import DeviceType

    steps = [e for e in events if e.name == STEP_RANGE and e.device_type == DeviceType.CPU]
    assert len(steps) == num_steps, f"found {len(steps)} {STEP_RANGE} ranges for {num_steps} steps"
    out = {"kernels_counted": "cuda device activities" if on_cuda else "leaf ATen ops that compute (CPU proxy)"}
    if on_cuda:
        device = [e for e in events if e.device_type == DeviceType.CUDA and e.name != STEP_RANGE
                  and not getattr(e, "is_user_annotation", False)]
        out["kernels_per_step"] = len(device) / num_steps
        out["host_launches_per_step"] = sum(e.name in _LAUNCH_CALLS for e in events) / num_steps
        out["graph_launches_per_step"] = sum(e.name in _GRAPH_LAUNCH for e in events) / num_steps
        # The device's own time, not clipped to the steps' host ranges: its timestamps need not
        # line up with the host's, so clipping would count a busy device as mostly idle.
        out["device_us_per_step"] = _union_us([(e.time_range.start, e.time_range.end) for e in device]) / num_steps
        out["top_kernels"] = top_kernels(device, num_steps)
    else:
        out["kernels_per_step"] = sum(_innermost_compute(e) for e in events) / num_steps
        out["host_launches_per_step"] = out["graph_launches_per_step"] = out["device_us_per_step"] = None
        out["top_kernels"] = None
    return out


def top_kernels(device_events, num_steps: int, top: int = TOP_KERNELS) -> list[dict]:
    """The device activities grouped by name: launches and microseconds per step, most time first."""
    totals: dict[str, list[float]] = {}
    for e in device_events:
        entry = totals.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.end - e.time_range.start
    rows = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    return [dict(name=name[:120], per_step=n / num_steps, us_per_step=us / num_steps) for name, (n, us) in rows]


def profile_steps(step, num_steps: int, on_cuda: bool, trace_path: str | None = None) -> dict:
    """Run step() num_steps times under torch.profiler; step_activity's counts (and a Chrome trace)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(num_steps):
            with record_function(STEP_RANGE):
                step()
        if on_cuda:
            torch.cuda.synchronize()
    if trace_path:
        prof.export_chrome_trace(trace_path)
    return step_activity(prof.events(), num_steps, on_cuda)


def weight_bytes(runner, batch: int) -> int:
    """Bytes of weights one decode step reads: every parameter once, except an untied input
    embedding, of which a step reads only its batch's rows."""
    total = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    hf = runner.hf_config
    if not getattr(hf, "tie_word_embeddings", False):
        total -= (hf.vocab_size - batch) * hf.hidden_size * runner.dtype.itemsize
    return total


def prefill_steps(batch: int, context: int, step_tokens: int) -> int:
    """Engine steps the batch's prompts take to prefill, step_tokens (max_num_batched_tokens) a step."""
    return -(-batch * context // step_tokens)


def _decode_steps_until_all_decoding(core, batch: int) -> None:
    """Step through the prefills until each of the batch's requests has its first token."""
    started: set[str] = set()
    while len(started) < batch:
        for out in core.step():
            if out.new_token_ids:
                started.add(out.request_id)


def request_ids(batch: int) -> list[str]:
    """The ids start_decoding gives a batch's requests (known before they are added, to abort them)."""
    return [f"anatomy-{batch}-{i}" for i in range(batch)]


def start_decoding(core, batch: int, context: int, max_tokens: int, seed: int = 0) -> list[str]:
    """Add `batch` requests of `context` random prompt tokens (greedy, EOS ignored, max_tokens new
    tokens each) and step until every one is decoding; their request ids."""
    from engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = request_ids(batch)
    for rid in ids:
        core.add_request(rid, [rng.randrange(3, core.vocab_size) for _ in range(context)], params)
    _decode_steps_until_all_decoding(core, batch)
    return ids


def measure_batch(llm, batch: int, context: int, steps: int, profile_steps_n: int, warmup: int = 3,
                  trace_path: str | None = None, seed: int = 0) -> dict:
    """One batch size on an engine built for it: the row of the report (times in ms)."""
    import torch

    core = llm.engine
    runner = core.runner
    on_cuda = runner.device.type == "cuda"
    # The first prompts decode while later ones are still prefilling (max_num_batched_tokens a
    # step): their token budget covers those steps too, or they finish inside the timed window.
    total = warmup + steps + profile_steps_n + 2 + prefill_steps(batch, context, core.config.max_num_batched_tokens)
    ids = request_ids(batch)
    try:
        start_decoding(core, batch, context, total, seed)
        for _ in range(warmup):
            core.step()
        if on_cuda:
            torch.cuda.synchronize()
        times, tokens = [], 0
        for _ in range(steps):
            start = time.perf_counter()
            outs = core.step()  # returns once the sampled ids are on the host
            times.append(time.perf_counter() - start)
            tokens += sum(len(o.new_token_ids) for o in outs)
        assert tokens == batch * steps, f"{tokens} tokens in {steps} steps at batch {batch}: not all decoding"
        activity = profile_steps(core.step, profile_steps_n, on_cuda, trace_path)
    finally:
        core.abort_request(ids)
        core.step()  # hands out the aborts; nothing is left running
    step_s = statistics.median(times)
    kv = batch * (context + warmup + steps // 2) * runner.kv_bytes_per_token()
    w = weight_bytes(runner, batch)
    # Busy against the unprofiled step: under the profiler the host runs slower, the GPU does not.
    device_us = activity["device_us_per_step"]
    activity["gpu_busy"] = None if device_us is None else min(1.0, device_us * 1e-6 / step_s)
    return dict(batch=batch, context=context, steps=steps, step_ms=step_s * 1e3,
                step_ms_min=min(times) * 1e3, tok_s=batch / step_s, weight_bytes=w, kv_bytes=kv,
                gb_per_s=(w + kv) / step_s / 1e9, num_layers=len(runner.model.layers()), **activity)


STEP_TOKENS = 2048  # max_num_batched_tokens of the engines built here (the engine's default)


def build_engine(model: str, max_batch: int, context: int, new_tokens: int, dtype: str, enforce_eager: bool | None,
                 attention_backend: str = "auto", block_size: int = 16, **engine_kwargs):
    """An engine sized for the run alone: a fixed number of KV blocks, so two can share a GPU.
    engine_kwargs: further EngineConfig fields (a probe's quantization, say)."""
    from engine.frontend.llm import LLM

    max_len = context + new_tokens + 64
    extra = {} if enforce_eager is None else {"enforce_eager": enforce_eager}
    # A CPU step prefills a whole token budget too, as prefill_steps counts (decode is what is measured).
    extra.update(cpu_max_prefill_tokens=STEP_TOKENS, cpu_max_prefill_attention=STEP_TOKENS * max_len)
    return LLM(model, dtype=dtype, max_num_seqs=max_batch, max_model_len=max_len, max_num_batched_tokens=STEP_TOKENS,
               num_kv_blocks=max_batch * -(-max_len // block_size) + 4, block_size=block_size,
               enable_prefix_caching=False, attention_backend=attention_backend, seed=0, **extra, **engine_kwargs)


_GRAPH_MODES = {"on": [("graphs", False)], "off": [("eager", True)], "both": [("graphs", False), ("eager", True)]}


def graph_modes(requested: str) -> list[tuple[str, bool | None]]:
    """--graphs on|off|both -> [(label, enforce_eager)]; without the config field: [("default", None)]."""
    return _GRAPH_MODES[requested] if supports_graph_switch() else [("default", None)]


def run(model: str, batch_sizes: list[int], context: int, steps: int, profile_steps_n: int, dtype: str,
        graphs: str = "both", attention_backend: str = "auto", trace_path: str | None = None,
        label: str | None = None) -> list[dict]:
    """Rows for every (graph mode, batch size); the engine of each mode is shut down before the next."""
    import gc

    import torch

    rows = []
    for m, (mode, eager) in enumerate(graph_modes(graphs)):
        new_tokens = 3 + steps + profile_steps_n + 2 + prefill_steps(max(batch_sizes), context, STEP_TOKENS)
        llm = build_engine(model, max(batch_sizes), context, new_tokens, dtype, eager, attention_backend)
        try:
            for i, batch in enumerate(batch_sizes):
                trace = trace_path if m == 0 and i == 0 else None  # one trace: the first batch
                row = measure_batch(llm, batch, context, steps, profile_steps_n, trace_path=trace)
                rows.append(dict(model=label or model, mode=mode, backend=llm.engine.runner.attn_backend,
                                 dtype=str(llm.engine.runner.dtype).removeprefix("torch."), **row))
                print(f"{rows[-1]['model']} {mode} batch {batch}: {row['step_ms']:.3f} ms/step, "
                      f"{row['tok_s']:.0f} tok/s, {row['kernels_per_step']:.0f} kernels/step", flush=True)
        finally:
            llm.shutdown()
            del llm
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.decode_anatomy", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model folder (engine.bench.random_model builds one)")
    p.add_argument("--label", default=None, help="the model's name in the report (default: its path)")
    p.add_argument("--batch-sizes", default="1,64", help="comma-separated")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens of each sequence")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size")
    p.add_argument("--profile-steps", type=int, default=5, help="decode steps under torch.profiler")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--graphs", choices=("on", "off", "both"), default="both",
                   help="CUDA graphs (EngineConfig.enforce_eager); ignored where the engine has no such switch")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--trace", default=None, help="Chrome trace of the first profiled batch (JSON file)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError:
        p.error(f"--batch-sizes takes integers like 1,64; got {args.batch_sizes!r}")
    if not batch_sizes or min(batch_sizes) < 1:
        p.error(f"--batch-sizes must be >= 1; got {args.batch_sizes!r}")
    rows = run(args.model, batch_sizes, args.context, args.steps, args.profile_steps, args.dtype, args.graphs,
               args.attention_backend, args.trace, args.label)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
