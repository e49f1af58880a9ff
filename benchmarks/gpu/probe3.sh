#!/usr/bin/env bash
# Session 12's third lease: the one-row GEMV for int4/int8 weights (kernel against the tl.dot
# kernel and cuBLAS), the GPU tests (tests/kernels without the CPU backend's cases, and tests/gpu;
# failures logged as they happen), batch-1 decode of the Llama-3.2-1B shape in bf16 / int4 / int8
# (step times, kernels per step), and a batch-1 attention sweep. Output under $OUT.
set -u
source benchmarks/gpu/lease_env.sh
t0=$(date +%s)
timeout 45 python3 benchmarks/gpu/gemv_bench.py 2>&1 | tee "$OUT/gemv_bench.log"
echo "gemv done at $(( $(date +%s) - t0 )) s"
timeout ${TESTS_S:-130} python3 -m pytest tests/kernels tests/gpu -k "not cpu" --ignore=tests/kernels/test_cpu_kernels.py \
    --ignore=tests/kernels/test_quant_kernels.py --ignore=tests/kernels/test_cpu_bench_smoke.py \
    --ignore=tests/kernels/test_kernels_compile_for_gpu.py -n 16 -q -rfE -p no:cacheprovider -p tests.failure_log \
    --failure-log="$OUT/failures.txt" >"$OUT/tests.log" 2>&1
echo "tests rc=$? at $(( $(date +%s) - t0 )) s"
grep -v "PytestBenchmarkWarning\|warner(" "$OUT/tests.log" | grep -v "^  \|^$" | tail -12
grep "^-----" "$OUT/failures.txt" 2>/dev/null | head -20
python3 -m engine.bench.random_model /tmp/llama-3.2-1b --preset llama-3.2-1b \
    --tokenizer engine/bench/assets/smollm2-tokenizer --dtype bfloat16 2>&1 | grep -v Writing
timeout 75 python3 benchmarks/gpu/host_profile.py --model /tmp/llama-3.2-1b --steps 100 --quantizations int4,int8 \
    --output-json "$OUT/host_profile.json" 2>&1 | grep -v "^ \+[0-9]\|^$\|Ordered\|List reduced\|ncalls\|function calls"
timeout 45 python3 benchmarks/gpu/kernel_profile.py --model /tmp/llama-3.2-1b --steps 10 --quantizations int4 --top 12 \
    --output-json "$OUT/kernel_profile.json" 2>&1 | grep -v "^USDT\|profiler_st"
echo "profiles done at $(( $(date +%s) - t0 )) s"
timeout 40 python3 benchmarks/gpu/attention_sweep.py --decode-shapes 1x1024,16x2048,1x4096 --prefill-shapes "" \
    --budget-s 60 --output-json "$OUT/attention_sweep.json" 2>&1 | grep "^decode\|^copy"
echo "all done at $(( $(date +%s) - t0 )) s"
