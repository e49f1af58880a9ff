#!/usr/bin/env bash
# Session 12's second lease: the kernel bench with the new decode tile, the kernels of a batch-1
# decode step (bf16 and int4), then the GPU tests touched since session 9 (failures logged as they
# happen). Output under $OUT.
set -u
source benchmarks/gpu/lease_env.sh
uptime
t0=$(date +%s)
timeout 60 python3 -m kernels.bench --output-json "$OUT/kernel_bench.json" --plot "$OUT/kernel_bench.png"
echo "bench in $(( $(date +%s) - t0 )) s"
python3 - <<'PY'
# cuBLAS at one row: each Llama-3.2-1B matmul shape's bandwidth (weight bytes / median time)
import torch, triton.testing as tt
for n, k in ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048)):
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda"); x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    ms = tt.do_bench(lambda: torch.nn.functional.linear(x, w), warmup=10, rep=50, return_mode="median")
    print(f"linear 1x{k} @ {n}x{k}: {ms * 1e3:.1f} us, {n * k * 2 / ms / 1e6:.0f} GB/s")
PY
python3 -m engine.bench.random_model /tmp/llama-3.2-1b --preset llama-3.2-1b \
    --tokenizer engine/bench/assets/smollm2-tokenizer --dtype bfloat16 2>&1 | grep -v Writing
timeout 90 python3 benchmarks/gpu/kernel_profile.py --model /tmp/llama-3.2-1b --quantizations int4 \
    --output-json "$OUT/kernel_profile.json" 2>&1 | grep -v "^USDT\|profiler_st"
echo "profile done at $(( $(date +%s) - t0 )) s"
timeout ${TESTS_S:-150} python3 -m pytest tests/gpu tests/kernels/test_fused_kernels.py tests/kernels/test_triton_warmup.py \
    tests/kernels/test_attention_launch_heuristics.py tests/kernels/test_fp8_weights_engine.py \
    tests/kernels/test_triton_quant.py -k "not cpu" -n 16 -q -rfE -p no:cacheprovider -p tests.failure_log \
    --failure-log="$OUT/failures.txt" --durations=25 >"$OUT/tests.log" 2>&1
echo "tests rc=$? at $(( $(date +%s) - t0 )) s"
grep -v "PytestBenchmarkWarning\|warner(" "$OUT/tests.log" | tail -45
head -c 6000 "$OUT/failures.txt" 2>/dev/null
