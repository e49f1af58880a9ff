#!/usr/bin/env bash
# Session 20's first lease: the one-row int4 kernel loading a step ahead (GEMV_PREFETCH) or not,
# swept over tiles on a 1B model's four matmul shapes; batch-1 decode steps (bf16 / int4) with the
# sweep's choice, and their kernels per step; then the GPU tests (sessions 14-19 changed shared
# engine code with no GPU to run them). Output under $OUT.
set -u
source benchmarks/gpu/lease_env.sh
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
timeout ${BENCH_S:-150} python3 benchmarks/gpu/packed_bench.py --sweep --formats Q4_1 --rows 1 \
    --best-json "$OUT/packed_best.json" --output-json "$OUT/packed_bench.json" 2>&1 \
    | tee "$OUT/packed_bench.log" | grep -v "^  .*Error"
echo "bench done at $(( $(date +%s) - t0 )) s"
python3 -m engine.bench.random_model /tmp/llama-3.2-1b --preset llama-3.2-1b \
    --tokenizer engine/bench/assets/smollm2-tokenizer --dtype bfloat16 2>&1 | grep -v Writing
tiles=""; [ -f "$OUT/packed_best.json" ] && tiles="--packed-tiles $OUT/packed_best.json"
timeout ${PROFILE_S:-100} python3 benchmarks/gpu/host_profile.py --model /tmp/llama-3.2-1b --steps 100 \
    --quantizations ${QUANTS:-int4} $tiles --output-json "$OUT/host_profile.json" 2>&1 \
    | grep -v "^ \+[0-9]\|^$\|Ordered\|List reduced\|ncalls\|function calls"
echo "profile done at $(( $(date +%s) - t0 )) s"
timeout ${KPROFILE_S:-80} python3 benchmarks/gpu/kernel_profile.py --model /tmp/llama-3.2-1b --steps 20 \
    --quantizations ${QUANTS:-int4} --top 14 $tiles --output-json "$OUT/kernel_profile.json" 2>&1 | grep -v "^$"
echo "kernel profile done at $(( $(date +%s) - t0 )) s"
[ "${TESTS_S:-150}" = 0 ] && exit 0
gpu_tests ${TESTS_S:-150} ${TESTS:-tests/kernels tests/gpu} -k "not cpu" \
    --ignore=tests/kernels/test_cpu_kernels.py --ignore=tests/kernels/test_quant_kernels.py \
    --ignore=tests/kernels/test_cpu_bench_smoke.py --ignore=tests/kernels/test_kernels_compile_for_gpu.py
