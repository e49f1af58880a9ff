#!/usr/bin/env bash
# Session 13's lease: the repacked 4/8-bit matmul (kernels/triton_quant_packed.py) against the
# GGUF-block kernel and cuBLAS bf16 on the Llama-3.2-1B shapes (CUDA-graph timing over weight
# copies beyond L2), a tile sweep at one row; batch-1 decode steps of that model in bf16 / int4 /
# int8; then the GPU tests (tests/gpu, tests/kernels but the CPU backend's; failures logged as they
# happen). Output under $OUT.
set -u
source benchmarks/gpu/lease_env.sh
t0=$(date +%s)
timeout ${BENCH_S:-130} python3 benchmarks/gpu/packed_bench.py ${BENCH_ARGS:---sweep} \
    --output-json "$OUT/packed_bench.json" 2>&1 | tee "$OUT/packed_bench.log" | grep -v "^  .*Error"
echo "bench done at $(( $(date +%s) - t0 )) s"
python3 -m engine.bench.random_model /tmp/llama-3.2-1b --preset llama-3.2-1b \
    --tokenizer engine/bench/assets/smollm2-tokenizer --dtype bfloat16 2>&1 | grep -v Writing
timeout ${PROFILE_S:-90} python3 benchmarks/gpu/host_profile.py --model /tmp/llama-3.2-1b --steps 100 \
    --quantizations int4,int8 --output-json "$OUT/host_profile.json" 2>&1 \
    | grep -v "^ \+[0-9]\|^$\|Ordered\|List reduced\|ncalls\|function calls"
echo "profile done at $(( $(date +%s) - t0 )) s"
[ "${TESTS_S:-150}" = 0 ] && exit 0
timeout ${TESTS_S:-150} python3 -m pytest ${TESTS:-tests/kernels tests/gpu} -k "not cpu" \
    --ignore=tests/kernels/test_cpu_kernels.py --ignore=tests/kernels/test_quant_kernels.py \
    --ignore=tests/kernels/test_cpu_bench_smoke.py --ignore=tests/kernels/test_kernels_compile_for_gpu.py \
    -n 16 -q -rfE -p no:cacheprovider -p tests.failure_log --failure-log="$OUT/failures.txt" >"$OUT/tests.log" 2>&1
echo "tests rc=$? at $(( $(date +%s) - t0 )) s"
grep -v "PytestBenchmarkWarning\|warner(" "$OUT/tests.log" | grep -v "^  \|^$" | tail -12
grep "^-----" "$OUT/failures.txt" 2>/dev/null | head -20
