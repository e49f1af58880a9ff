"""kernels/cpu_ops.cpp's paged attention as of another commit against the working tree's, in one
process and alternating rounds (this machine's speed moves 20-40% within minutes): --rows decode rows
(one sequence each) of the default model's attention shape (9 query heads on 3 KV heads of 64) over
30 layers' caches (float32, or --dtype bfloat16), each sequence a context of the given length in shuffled blocks of 16,
cold (a 64 MB write between repetitions). Prints each build's median over the rounds of its best of
3 and the largest output difference between the two.

    python benchmarks/quant/attention_ab.py COMMIT [--contexts 100,200,500,1800] [--rows 1] [--rounds 10]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path


def main() -> None:
    import torch

    from kernels import cpu_build

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("commit")
    p.add_argument("--contexts", default="100,200,500,1800")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the query's and caches' dtype (a bfloat16 model's is bfloat16)")
    args = p.parse_args()
    torch.set_num_threads(args.num_threads)
    source = subprocess.run(["git", "show", f"{args.commit}:kernels/cpu_ops.cpp"], check=True,
                            capture_output=True, text=True).stdout
    # Two builds of one module in a process: their pybind classes must not both register globally.
    source = re.sub(r'pybind11::class_<(\w+)>\(m, "(\w+)"\)',
                    r'pybind11::class_<\1>(m, "\2", pybind11::module_local())', source)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "cpu_ops.cpp"
        path.write_text(source)
        builds = {"old": cpu_build._build(path, "pagewise_cpu_ab"), "new": cpu_build.load()}
    layers, kv_heads, heads, dim, block = 30, 3, 9, 64, 16
    flush = torch.empty(64 << 20, dtype=torch.uint8)
    for context in (int(c) for c in args.contexts.split(",")):
        per_seq = -(-context // block)
        blocks = per_seq * args.rows + 1
        dtype = getattr(torch, args.dtype)
        caches = [(torch.randn(kv_heads, blocks, dim, block, dtype=dtype),
                   torch.randn(kv_heads, blocks, dim, block, dtype=dtype)) for _ in range(layers)]
        table = torch.randperm(blocks)[:per_seq * args.rows].reshape(args.rows, per_seq).contiguous()
        query = torch.randn(args.rows, heads, dim, dtype=dtype)
        row_seq, lens = torch.arange(args.rows), torch.full((args.rows,), context)
        times: dict[str, list[float]] = {"old": [], "new": []}
        outs = {}
        for r in range(args.rounds):
            for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
                best = float("inf")
                for _ in range(3):
                    flush.add_(1)
                    out = torch.empty(args.rows, heads, dim, dtype=dtype)
                    start = time.perf_counter()
                    for k, v in caches:
                        builds[name].paged_attention(out, query, k, v, table, row_seq, lens, dim ** -0.5, 1.0, 1.0)
                    best = min(best, time.perf_counter() - start)
                times[name].append(best)
                outs[name] = out
        old, new = statistics.median(times["old"]), statistics.median(times["new"])
        print(f"context {context}: {args.commit} {old * 1e6:.0f} us, working tree {new * 1e6:.0f} us "
              f"({layers} layers), {old / new:.3f}x; largest difference "
              f"{(outs['old'].float() - outs['new'].float()).abs().max().item():.1e}", flush=True)


if __name__ == "__main__":
    main()
