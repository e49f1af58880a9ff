#!/usr/bin/env bash
# Single-sequence decode on the default model's Q4_1 file: the fused C++ decoder layers
# (EngineConfig.cpu_fused_layers, the default) against the modules op by op, alternating in one
# run, then llama-bench on the same file with the same threads. JSON: benchmarks/quant/fused-*.json.
set -eu
G=$(python -c "from engine.loading.default_model import default_gguf_path; print(default_gguf_path())")
PAIRS=${PAIRS:-3}
THREADS=${THREADS:-2}
LLAMA_BENCH=${LLAMA_BENCH:-/opt/llamacpp/bin/llama-bench}
for i in $(seq 1 "$PAIRS"); do
    for mode in fused modules; do
        flag=$([ "$mode" = fused ] && echo --cpu-fused-layers || echo --no-cpu-fused-layers)
        echo "== $mode $i, load $(cut -d' ' -f1 /proc/loadavg)"
        python -m engine.cli bench latency --backend engine --batch-size 1 --model "$G" --input-len 128 \
            --output-len 128 --num-iters 3 --num-threads "$THREADS" "$flag" --disable-tqdm \
            --output-json "benchmarks/quant/fused-$mode-$i.json" 2>&1 | grep -E "TPOT|decode|tok/s" | head -4
    done
done
if [ -x "$LLAMA_BENCH" ]; then
    echo "== llama-bench, load $(cut -d' ' -f1 /proc/loadavg)"
    "$LLAMA_BENCH" -m "$G" -t "$THREADS" -p 128 -n 128 -r 3
fi
