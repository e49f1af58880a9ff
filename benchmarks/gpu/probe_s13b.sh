#!/usr/bin/env bash
# Session 13's last lease: the one-row CUDA-core kernel on repacked 4/8-bit weights, rewritten with
# every tensor in the words' layout; its tests; a tile sweep over a 1B model's four matmul shapes,
# whose choice the batch-1 decode steps (bf16 / int4 / int8) then run with. Output under $OUT.
set -u
source benchmarks/gpu/lease_env.sh
t0=$(date +%s)
timeout ${TESTS_S:-50} python3 -m pytest tests/kernels/test_triton_quant_packed.py -n 16 -q -rfE -p no:cacheprovider \
    -p tests.failure_log --failure-log="$OUT/failures.txt" >"$OUT/tests.log" 2>&1
echo "tests rc=$? at $(( $(date +%s) - t0 )) s"
grep -v "PytestBenchmarkWarning\|warner(" "$OUT/tests.log" | grep -v "^  \|^$" | tail -6
grep "^-----" "$OUT/failures.txt" 2>/dev/null | head -8
timeout ${BENCH_S:-110} python3 benchmarks/gpu/packed_bench.py --sweep --best-json "$OUT/packed_best.json" \
    --output-json "$OUT/packed_bench.json" 2>&1 | tee "$OUT/packed_bench.log" | grep -v "^  .*Error"
echo "bench done at $(( $(date +%s) - t0 )) s"
python3 -m engine.bench.random_model /tmp/llama-3.2-1b --preset llama-3.2-1b \
    --tokenizer engine/bench/assets/smollm2-tokenizer --dtype bfloat16 2>&1 | grep -v Writing
tiles=""; [ -f "$OUT/packed_best.json" ] && tiles="--packed-tiles $OUT/packed_best.json"
timeout ${PROFILE_S:-75} python3 benchmarks/gpu/host_profile.py --model /tmp/llama-3.2-1b --steps 100 \
    --quantizations int4,int8 $tiles --output-json "$OUT/host_profile.json" 2>&1 \
    | grep -v "^ \+[0-9]\|^$\|Ordered\|List reduced\|ncalls\|function calls"
echo "all done at $(( $(date +%s) - t0 )) s"
