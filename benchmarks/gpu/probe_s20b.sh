#!/usr/bin/env bash
# Session 20's second lease: the one-row kernel with its K-split partials summed by the last split
# to arrive (one launch a matmul) and unmasked whole tiles: its tests and the GPU tests first, a
# tile sweep, then batch-1 decode steps of a Llama-3.2-1B shape, the session's start (.base, a
# copy of HEAD's engine and kernels) against now, now with the LM head quantized too, and with
# attention split into more parts (MIN_KEYS_PER_SPLIT 128). Output under $OUT.
set -u
source benchmarks/gpu/lease_env.sh
t0=$(date +%s)
stamp() { echo "== $1 at $(( $(date +%s) - t0 )) s"; }
gpu_tests ${TESTS_S:-90} tests/kernels/test_triton_quant_packed.py tests/kernels/test_triton_quant.py \
    tests/kernels/test_triton_warmup.py tests/gpu
stamp tests
timeout ${BENCH_S:-80} python3 benchmarks/gpu/packed_bench.py --sweep --formats Q4_1 --rows 1 \
    --best-json "$OUT/packed_best.json" --output-json "$OUT/packed_bench.json" 2>&1 \
    | tee "$OUT/packed_bench.log" | grep -v "^  .*Error"
stamp bench
python3 -m engine.bench.random_model /tmp/llama-3.2-1b --preset llama-3.2-1b \
    --tokenizer engine/bench/assets/smollm2-tokenizer --dtype bfloat16 2>&1 | grep -v Writing
tiles=""; [ -f "$OUT/packed_best.json" ] && tiles="--packed-tiles $OUT/packed_best.json"
profile() {  # label, directory, then host_profile's arguments
    local label=$1 dir=$2; shift 2
    (cd "$dir" && PYTHONPATH=.:/tmp/site timeout ${PROFILE_S:-75} python3 benchmarks/gpu/host_profile.py \
        --model /tmp/llama-3.2-1b --steps 100 --output-json "$OUT/host_$label.json" "$@" 2>&1 \
        | grep -v "^ \+[0-9]\|^$\|Ordered\|List reduced\|ncalls\|function calls\|^  \|  [a-z_]*(")
    stamp "$label"
}
profile before .base --quantizations int4
profile after . --quantizations int4,int4+head $tiles
profile splits128 . --quantizations int4+head $tiles --set kernels.triton_heuristics.MIN_KEYS_PER_SPLIT=128
timeout ${KPROFILE_S:-45} python3 benchmarks/gpu/kernel_profile.py --model /tmp/llama-3.2-1b --steps 20 \
    --quantizations int4+head --top 12 $tiles --output-json "$OUT/kernel_profile.json" 2>&1 | grep -v "^$\|Warn\|_warn"
stamp "kernel profile"
