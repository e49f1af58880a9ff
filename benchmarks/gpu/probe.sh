#!/usr/bin/env bash
# Session 12's first lease: the tests session 9's run failed (fixed since, never rerun on a GPU) and
# tests/gpu; the attention launch sweep; the host-time breakdown of a batch-1 decode step and
# weight-only quantization at batch 1. Output under $OUT.
set -u
source benchmarks/gpu/lease_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
uptime; git log --oneline -1 2>/dev/null
t0=$(date +%s)
timeout ${TESTS_S:-120} python3 -m pytest tests/gpu tests/kernels/test_fused_kernels.py tests/kernels/test_fp8_weights_engine.py \
    tests/kernels/test_triton_quant.py -k "not cpu" -n 16 -q -rfE -p no:cacheprovider --tb=short >"$OUT/tests.log" 2>&1
echo "tests rc=$? in $(( $(date +%s) - t0 )) s"; tail -25 "$OUT/tests.log"
t0=$(date +%s)
timeout ${SWEEP_S:-170} env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/gpu/attention_sweep.py --budget-s $(( ${SWEEP_S:-170} - 20 )) \
    --output-json "$OUT/attention_sweep.json" 2>&1 | tee "$OUT/attention_sweep.log" | grep -v "^prefill top"
echo "sweep in $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
python3 -m engine.bench.random_model /tmp/llama-3.2-1b --preset llama-3.2-1b \
    --tokenizer engine/bench/assets/smollm2-tokenizer --dtype bfloat16
echo "build in $(( $(date +%s) - t0 )) s"
timeout ${HOST_S:-150} env PYTHONPATH=.:${PYTHONPATH:-} python3 benchmarks/gpu/host_profile.py --model /tmp/llama-3.2-1b --steps 150 \
    --quantizations int4,int8 --output-json "$OUT/host_profile.json" 2>&1 | tee "$OUT/host_profile.log" | head -80
