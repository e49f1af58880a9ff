#!/usr/bin/env bash
# Single-sequence decode on the default model's Q4_1 file, pagewise against llama.cpp, in rounds that
# alternate the two (this machine's load moves on the scale of a minute, so one run of each is not a
# comparison). Both decode 128 tokens after a 128-token context with the same threads:
#   pagewise: `engine bench latency --batch-size 1 --input-len 128 --output-len 128` (TPOT: a step's
#             forward, greedy sampling and detokenization);
#   llama.cpp: `llama-bench -p 0 -n 128 -d 128` (tg128 @ d128: the forward alone).
# JSON per round: benchmarks/quant/decode-vs-llamacpp/{engine,llamacpp}-N.json; the summary (each
# round's tok/s and load, medians, the ratio) is printed and written to summary.json there.
set -eu
G=$(python -c "from engine.default_model import default_gguf_path; print(default_gguf_path())")
ROUNDS=${ROUNDS:-5}
THREADS=${THREADS:-2}
LLAMA_BENCH=${LLAMA_BENCH:-/opt/llamacpp/bin/llama-bench}
OUT=${OUT:-benchmarks/quant/decode-vs-llamacpp}
mkdir -p "$OUT"
for i in $(seq 1 "$ROUNDS"); do
    echo "== round $i: pagewise, load $(cut -d' ' -f1 /proc/loadavg)"
    python -m engine.cli bench latency --backend engine --batch-size 1 --model "$G" --input-len 128 \
        --output-len 128 --num-iters 3 --num-threads "$THREADS" --disable-tqdm \
        --output-json "$OUT/engine-$i.json" > /dev/null 2>&1
    echo "== round $i: llama.cpp, load $(cut -d' ' -f1 /proc/loadavg)"
    "$LLAMA_BENCH" -m "$G" -t "$THREADS" -p 0 -n 128 -d 128 -r 3 -o json > "$OUT/llamacpp-$i.json" 2>/dev/null
done
python - "$OUT" "$ROUNDS" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
rows = []
for i in range(1, rounds + 1):
    e = json.load(open(f"{out}/engine-{i}.json"))
    engine = 1000.0 / e["results"][0]["tpot"]["median_ms"]
    l = json.load(open(f"{out}/llamacpp-{i}.json"))
    llama = l[0]["avg_ts"]
    rows.append({"round": i, "pagewise_tok_s": round(engine, 2), "llamacpp_tok_s": round(llama, 2),
                 "ratio": round(engine / llama, 3), "load": e["environment"]["load_average"][0]})
    print(f"round {i}: pagewise {engine:6.1f} tok/s  llama.cpp {llama:6.1f} tok/s  ratio {engine / llama:.3f}")
med_e = statistics.median(r["pagewise_tok_s"] for r in rows)
med_l = statistics.median(r["llamacpp_tok_s"] for r in rows)
ratios = [r["ratio"] for r in rows]
print(f"medians: pagewise {med_e:.1f}, llama.cpp {med_l:.1f} tok/s: {med_e / med_l:.3f}x; "
      f"per-round ratios {min(ratios):.3f}-{max(ratios):.3f}, median {statistics.median(ratios):.3f}")
json.dump({"rounds": rows, "median_pagewise": med_e, "median_llamacpp": med_l, "ratio_of_medians": med_e / med_l,
           "median_ratio": statistics.median(ratios)}, open(f"{out}/summary.json", "w"), indent=1)
PY
