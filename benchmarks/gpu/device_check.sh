#!/usr/bin/env bash
# A GPU machine's check, run from the repository root on it:
#   bash benchmarks/gpu/device_check.sh [check|throughput|all]
# check: python -m engine.bench.gpu_check (env, kernel + gpu tests, kernel bench, decode anatomy);
# throughput: engine vs transformers generate on the SmolLM2-135M shape (random weights, bf16,
# random-length 100-1024 in and out), the ">= 5x transformers" bar.
# Wheels the image lacks (gguf, the kernel tests' oracle) travel in .whl/; results go to $OUT.
set -u
source benchmarks/gpu/device_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.max.sm --format=csv
uptime
what=${1:-all}
if [ "$what" = check ] || [ "$what" = all ]; then
    python3 -m engine.bench.gpu_check --output-dir "$OUT" --time-scale "${TIME_SCALE:-1.0}" ${GPU_CHECK_ARGS:-}
fi
if [ "$what" = throughput ] || [ "$what" = all ]; then
    model=/tmp/random-smollm2-135m
    python3 -m engine.bench.random_model "$model" --preset smollm2-135m \
        --tokenizer engine/bench/assets/smollm2-tokenizer --dtype bfloat16
    timeout "${THROUGHPUT_S:-600}" python3 -m engine.bench.cli throughput --model "$model" --dtype bfloat16 \
        --num-prompts "${NUM_PROMPTS:-256}" --input-len 562 --output-len 562 --random-range-ratio 0.82 \
        --hf-max-batch-size "${HF_BATCH:-128}" --compare engine,hf --disable-tqdm \
        --output-json "$OUT/throughput.json" --plot "$OUT/throughput.png"
fi
