"""Session 13: the cpu paged_attention op of one built extension, batch-1 decode, contexts 128-2048.

    python benchmarks/quant/s13/attention_one_build.py HASH

HASH: the torch-extension hash of a pagewise_cpu build in torch's extension cache. Run alternately
for two builds (the HEAD of the time and the key-split change that was then dropped) to produce
attention-split-ab.txt; prints {context: [median us a call, output sum]} as JSON.
"""

import importlib.util
import json
import statistics
import sys
import time

import torch

torch.set_num_threads(2)
name = f"pagewise_cpu_{sys.argv[1]}"
spec = importlib.util.spec_from_file_location(name, f"/root/.cache/torch_extensions/py311_cpu/{name}/{name}.so")
ops = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ops)
kv_heads, group, dim, block_size = 3, 3, 64, 16  # the default model's attention
result = {}
for context in (128, 256, 1024, 2048):
    num_blocks = context // block_size + 1
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(kv_heads, num_blocks, dim, block_size, generator=gen)
    v = torch.randn(kv_heads, num_blocks, block_size, dim, generator=gen)
    q = torch.randn(1, kv_heads * group, dim, generator=gen)
    out = torch.empty_like(q)
    table = torch.arange(num_blocks).view(1, -1).long()
    args = (q, k, v, table, torch.zeros(1, dtype=torch.long), torch.tensor([context]), 0.125, 1.0, 1.0)
    reps = max(50, 40000 // context)
    ops.paged_attention(out, *args)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(reps):
            ops.paged_attention(out, *args)
        times.append((time.perf_counter() - start) / reps * 1e6)
    result[context] = [statistics.median(times), out.sum().item()]
print(json.dumps(result))
