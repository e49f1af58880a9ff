"""Benchmark the cpu backend against the torch reference, op by op, on the same inputs.

  python -m kernels.cpu_bench [--dtype bfloat16] [--threads N] [--only MoE] [--output-json out.json] [--plot out.png]
  python -m kernels.cpu_bench --lora [--dtype bfloat16] [--threads N]

Shapes are the default model's (SmolLM2-135M: 9 query / 3 KV heads of 64, hidden 576, SwiGLU
1536, vocabulary 49,152) at the batch sizes of the engine's benchmark: decode = 64 sequences,
prefill = 2,048 tokens; the MoE rows are a tiny Mixtral-like layer (8 experts of hidden 576 and
ffn 768, top-2) at decode sizes (1 to 256 tokens) and the prefill budget, and a Qwen-MoE-like one
(64 fine-grained experts of ffn 256, top-8), the cpu op once per packed layout (pack_moe_weights'
brgemm, matmul and blocks). Decode attention runs over as many layers' caches as the model has, and an MoE
row over MOE_LAYERS layers' weights, so keys, values and expert weights come from memory as they do
in a real step, not from a warm cache. Each time is the median of repeated runs, the
two backends' runs interleaved; the table gives both and their ratio (reference / cpu).

--lora times multi-LoRA instead: a decode batch (1 and 32 tokens) over LORA_ADAPTERS adapters of
rank LORA_RANK, the tokens taking them in turn, on each projection of SmolLM2-135M and of a
Llama-3.2-1B-sized model (fused q/k/v and gate/up as one shrink and one expand). Each row gives the
base linear's time (the cpu backend's matmul on its packed weight) and shrink + expand's on each
backend, as a fraction of that linear, all measured interleaved in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from tqdm import tqdm

import kernels

LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, VOCAB, BLOCK = 30, 9, 3, 64, 576, 1536, 49152, 16
EXPERTS, TOP_K, EXPERT_FFN = 8, 2, 768
MOE_LAYERS = 12  # the random mixtral-tiny's depth (engine.bench.random_model)
# name -> (experts, top_k, ffn, token counts)
MOE_SHAPES = {"Mixtral-like": (EXPERTS, TOP_K, EXPERT_FFN, (1, 16, 64, 256, 2048)),
              "Qwen-MoE-like": (64, 8, 256, (16, 256))}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
LORA_ADAPTERS, LORA_RANK = 4, 16
# model -> projection -> (in features, out_slices): a fused projection's parts are its slices.
LORA_SHAPES = {
    "SmolLM2-135M": {"qkv": (576, (576, 192, 192)), "o": (576, (576,)), "gate/up": (576, (1536, 1536)),
                     "down": (1536, (576,))},
    "1B": {"qkv": (2048, (2048, 512, 512)), "o": (2048, (2048,)), "gate/up": (2048, (8192, 8192)),
           "down": (8192, (2048,))},
}


def median_ms(fns, runs: int) -> list[float]:
    """Median time of each callable, their runs interleaved so a drift in the machine's speed
    (these machines are shared) lands on every callable alike."""
    times = [[] for _ in fns]
    for fn in fns:
        fn()  # first call: kernel build, primitive creation, page faults
    for _ in range(runs):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return [statistics.median(ts) * 1e3 for ts in times]


def attention_case(backend: str, seqs: int, q_len: int, context: int, layers: int, dtype, gen):
    """A callable running `layers` layers' attention over fresh caches, blocks scattered."""
    per_seq = -(-context // BLOCK)
    num_blocks = seqs * per_seq + 1
    caches = []
    for _ in range(layers):
        k, v = kernels.allocate_kv_cache(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype, "cpu", backend=backend)
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
        caches.append((k, v))
    tables = torch.randperm(num_blocks, generator=gen)[: seqs * per_seq].view(seqs, per_seq).int()
    query = torch.randn(seqs * q_len, HEADS, HEAD_DIM, generator=gen).to(dtype)
    starts = (torch.arange(seqs + 1) * q_len).int()
    lens = torch.full((seqs,), context, dtype=torch.int32)
    plan = kernels.plan_attention(tables, starts, lens, BLOCK, backend=backend)

    def run():
        for k, v in caches:
            kernels.paged_attention(query, k, v, tables, starts, lens, HEAD_DIM ** -0.5, backend=backend, plan=plan)
    return run


def cases(dtype, gen):
    """name -> (torch-backend callable, cpu-backend callable) on the same inputs."""
    out = {}
    for name, seqs, q_len, context in (("decode attention, 64 seqs x 256 ctx", 64, 1, 256),
                                       ("prefill attention, 16 x 128-token prompts", 16, 128, 128),
                                       ("prefill attention, 1 x 1024-token prompt", 1, 1024, 1024),
                                       ("prefill attention, 1 x 2048-token prompt", 1, 2048, 2048)):
        layers = LAYERS if q_len == 1 else 1
        out[name + f" ({layers} layer{'s' if layers > 1 else ''})"] = tuple(
            attention_case(b, seqs, q_len, context, layers, dtype, gen) for b in ("torch", "cpu"))
    for rows in (64, 2048):
        out.update(row_cases(rows, dtype, gen))
    for name, (experts, top_k, ffn, token_counts) in MOE_SHAPES.items():
        out.update(moe_cases(name, experts, top_k, ffn, token_counts, dtype, gen))
    return out


def moe_cases(name: str, experts: int, top_k: int, ffn: int, token_counts, dtype, gen) -> dict:
    """MOE_LAYERS MoE layers at each token count: the reference's expert loop against the fused cpu
    op, once per layout pack_moe_weights can give here (bf16: brgemm where the CPU has AMX, matmul
    (None, i.e. the plain weights, where oneDNN cannot pack bf16) and blocks; other dtypes: the plain
    weights)."""
    from kernels import cpu_ops

    layers = [((torch.randn(experts, 2 * ffn, HIDDEN, generator=gen) / HIDDEN ** 0.5).to(dtype),
               (torch.randn(experts, HIDDEN, ffn, generator=gen) / ffn ** 0.5).to(dtype)) for _ in range(MOE_LAYERS)]
    layouts = {"plain": [None] * MOE_LAYERS}
    if dtype == torch.bfloat16:
        layouts = {"matmul": [cpu_ops.pack_moe_weights(w13, w2, "matmul") for w13, w2 in layers],
                   "blocks": [cpu_ops.pack_moe_weights(w13, w2, "blocks") for w13, w2 in layers]}
        if cpu_ops.load().moe_brgemm_available():
            layouts["brgemm"] = [cpu_ops.pack_moe_weights(w13, w2, "brgemm") for w13, w2 in layers]
    out = {}
    for rows in token_counts:
        x = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
        weights, ids = kernels.select_experts(torch.randn(rows, experts, generator=gen), top_k, True)

        def run(packs, backend, x=x, weights=weights, ids=ids):
            for (w13, w2), packed in zip(layers, packs):
                kernels.fused_moe(x, weights, ids, w13, w2, packed=packed, backend=backend)
        for layout, packs in layouts.items():
            key = (f"{name} MoE ({experts} experts, top-{top_k}, {HIDDEN} x {ffn}, {MOE_LAYERS} layers), "
                   f"{rows} tokens, {layout}")
            out[key] = (lambda run=run: run([None] * MOE_LAYERS, "torch"), lambda run=run, p=packs: run(p, "cpu"))
    return out


def row_cases(rows: int, dtype, gen) -> dict:
    """The per-token ops at `rows` tokens (a decode batch or a prefill budget)."""
    x, res = (torch.randn(rows, HIDDEN, generator=gen).to(dtype) for _ in range(2))
    w = torch.randn(HIDDEN, generator=gen).to(dtype)
    gate_up = torch.randn(rows, 2 * INTER, generator=gen).to(dtype)
    qkv = torch.randn(rows, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    cos, sin = (torch.rand(rows, 1, HEAD_DIM // 2, generator=gen).to(dtype) for _ in range(2))
    ops = {
        "residual add + RMSNorm": lambda b: kernels.rms_norm(x, w, 1e-5, res, backend=b),
        "SwiGLU": lambda b: kernels.silu_and_mul(gate_up, backend=b),
        "rotary (q and k)": lambda b: kernels.apply_rotary(qkv[:, :HEADS + KV_HEADS], cos, sin, backend=b),
    }
    out = {f"{name}, {rows} tokens": (lambda fn=fn: fn("torch"), lambda fn=fn: fn("cpu")) for name, fn in ops.items()}
    shapes = {"gate/up projection": (2 * INTER, HIDDEN)}
    if rows <= 64:
        shapes["LM head"] = (VOCAB, HIDDEN)  # decode only: prefill computes logits for its last tokens
    for name, (n_out, n_in) in shapes.items():
        weight = torch.randn(n_out, n_in, generator=gen).to(dtype)
        packed = kernels.pack_linear_weight(weight, backend="cpu")
        inp = torch.randn(rows, n_in, generator=gen).to(dtype)
        out[f"{name} matmul, {rows} tokens"] = (lambda w=weight, i=inp: kernels.linear(i, w),
                                                lambda w=weight, i=inp, p=packed: kernels.linear(i, w, None, p))
    return out


def lora_rows(dtype, runs: int, gen) -> list[dict]:
    """For each model, token count and projection: the base linear and shrink + expand on each backend."""
    rows = []
    for model, projections in LORA_SHAPES.items():
        for tokens in (1, 32):
            for projection, (k, out_slices) in projections.items():
                m = sum(out_slices)
                weight = (torch.randn(m, k, generator=gen) / k ** 0.5).to(dtype)
                packed = kernels.pack_linear_weight(weight, backend="cpu")
                x = torch.randn(tokens, k, generator=gen).to(dtype)
                n = len(out_slices) * LORA_RANK
                lora_a = (torch.randn(LORA_ADAPTERS, n, k, generator=gen) / k ** 0.5).to(dtype)
                lora_b = (torch.randn(LORA_ADAPTERS, m, LORA_RANK, generator=gen) / LORA_RANK ** 0.5).to(dtype)
                slots = (torch.arange(tokens) % LORA_ADAPTERS).to(torch.int32)
                y = torch.zeros(tokens, m, dtype=dtype)

                def lora(backend, x=x, lora_a=lora_a, lora_b=lora_b, slots=slots, y=y, out_slices=out_slices):
                    buf = kernels.lora_shrink(x, lora_a, slots, backend=backend)
                    kernels.lora_expand(y, buf, lora_b, slots, out_slices, backend=backend)
                base_ms, cpu_ms, torch_ms = median_ms(
                    (lambda x=x, w=weight, p=packed: kernels.linear(x, w, None, p),
                     lambda lora=lora: lora("cpu"), lambda lora=lora: lora("torch")), runs)
                rows.append({"model": model, "projection": f"{projection} {k} -> {'+'.join(map(str, out_slices))}",
                             "tokens": tokens, "linear_ms": base_ms, "cpu_ms": cpu_ms, "torch_ms": torch_ms})
    return rows


def print_lora(rows: list[dict]) -> None:
    print("| model | projection | tokens | linear ms | LoRA cpu ms | cpu / linear | LoRA torch ms | torch / linear |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['projection']} | {r['tokens']} | {r['linear_ms']:.3f} | {r['cpu_ms']:.3f} | "
              f"{r['cpu_ms'] / r['linear_ms']:.2f} | {r['torch_ms']:.3f} | {r['torch_ms'] / r['linear_ms']:.2f} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.cpu_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--runs", type=int, default=15)
    p.add_argument("--only", default=None, help="time only the ops whose name contains this text (e.g. MoE)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="write a PNG of the ratios (needs matplotlib)")
    p.add_argument("--lora", action="store_true", help="time multi-LoRA shrink + expand against the base linear")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels.resolve_backend("cpu", "cpu")  # builds the C++ kernels now, or says why it cannot
    gen = torch.Generator().manual_seed(0)
    if args.lora:
        rows = lora_rows(DTYPES[args.dtype], args.runs, gen)
        print(f"\ndtype {args.dtype}, threads {torch.get_num_threads()}, median of {args.runs} runs, "
              f"{LORA_ADAPTERS} adapters of rank {LORA_RANK}\n")
        print_lora(rows)
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump({"dtype": args.dtype, "threads": torch.get_num_threads(), "runs": args.runs, "lora": rows},
                          f, indent=2)
        return 0
    rows = []
    selected = {k: v for k, v in cases(DTYPES[args.dtype], gen).items() if args.only is None or args.only in k}
    for name, (ref, cpu) in tqdm(selected.items(), desc="ops"):
        ref_ms, cpu_ms = median_ms((ref, cpu), args.runs)
        rows.append({"op": name, "torch_ms": ref_ms, "cpu_ms": cpu_ms, "speedup": ref_ms / cpu_ms})
    print(f"\ndtype {args.dtype}, threads {torch.get_num_threads()}, median of {args.runs} runs\n")
    print("| op | torch ms | cpu ms | torch / cpu |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['op']} | {r['torch_ms']:.3f} | {r['cpu_ms']:.3f} | {r['speedup']:.2f}x |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"dtype": args.dtype, "threads": torch.get_num_threads(), "runs": args.runs, "rows": rows},
                      f, indent=2)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 0.4 * len(rows) + 1.2))
        ax.barh([r["op"] for r in rows][::-1], [r["speedup"] for r in rows][::-1])
        ax.axvline(1.0, color="gray", linestyle="--")
        ax.set_xlabel("speedup of the cpu backend over the torch reference (x)")
        ax.set_title(f"kernels.cpu_bench, {args.dtype}, {torch.get_num_threads()} threads")
        fig.tight_layout()
        fig.savefig(args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
