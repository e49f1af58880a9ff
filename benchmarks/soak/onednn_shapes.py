"""What grew in the soak: oneDNN's per-shape state. One packed bf16 weight (the default model's
576 -> 1536), 4,000 matmuls with a random row count in 1..3000, RSS printed every 1,000 calls and
the growth after the first 500. The first argument sets ONEDNN_PRIMITIVE_CACHE_CAPACITY ("none":
oneDNN's default); a second one rounds the row count up to a multiple of it (a bounded set).

    python benchmarks/soak/onednn_shapes.py 64        # every row count new: grows ~0.23 MiB per count
    python benchmarks/soak/onednn_shapes.py 8 64      # 47 counts, cache smaller than that: flat
"""

import os
import random
import sys

cap = sys.argv[1]
if cap != "none":
    os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = cap  # before torch builds its first primitive
import torch  # noqa: E402


def rss_mib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024


packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(1536, 576, dtype=torch.bfloat16), 64)
rng = random.Random(0)
base = None
for i in range(4000):
    m = rng.randint(1, 3000)
    if len(sys.argv) > 2:
        g = int(sys.argv[2])
        m = -(-m // g) * g
    torch.ops.mkldnn._linear_pointwise(torch.randn(m, 576, dtype=torch.bfloat16), packed, None, "none", [], "")
    if i == 500:
        base = rss_mib()
    if i % 1000 == 999:
        print(i + 1, "calls, RSS", rss_mib(), "MiB", flush=True)
print(f"cache {cap}, rounding {sys.argv[2] if len(sys.argv) > 2 else 'none'}: RSS growth after 500 calls "
      f"{rss_mib() - base} MiB")
