#!/usr/bin/env bash
# Single-sequence decode on the default model's Q4_1 file, pagewise against llama.cpp, in rounds that
# alternate them (this machine's load moves on the scale of a minute, so one run of each is not a
# comparison). Both decode 128 tokens after a 128-token context with the same threads:
#   pagewise: `engine bench latency --batch-size 1 --input-len 128 --output-len 128` (TPOT: a step's
#             forward, greedy sampling and detokenization), once per activation kind in KINDS
#             (--cpu-gguf-activations: int16, the default; int8, llama.cpp's; float);
#   llama.cpp: `llama-bench -p 0 -n 128 -d 128` (tg128 @ d128: the forward alone).
# JSON per round: $OUT/{engine-KIND,llamacpp}-N.json; the summary (each round's tok/s and load, each
# kind's medians and ratios to the same round's llama.cpp) is printed and written to $OUT/summary.json.
# MODEL: another .gguf file (default: the default model's Q4_1 file), e.g. its BF16 rewrite
# (benchmarks/llamacpp/to_bf16_gguf.py), whose "kind" is then only a label (no block matmuls).
# EXTRA: more flags for pagewise, e.g. "--kv-cache-dtype float16" (llama.cpp's default KV type).
set -eu
G=${MODEL:-$(python -c "from engine.loading.default_model import default_gguf_path; print(default_gguf_path())")}
ROUNDS=${ROUNDS:-5}
THREADS=${THREADS:-2}
KINDS=${KINDS:-int16}
LLAMA_BENCH=${LLAMA_BENCH:-/opt/llamacpp/bin/llama-bench}
OUT=${OUT:-benchmarks/quant/decode-vs-llamacpp}
mkdir -p "$OUT"
for i in $(seq 1 "$ROUNDS"); do
    for kind in $KINDS; do
        echo "== round $i: pagewise ($kind), load $(cut -d' ' -f1 /proc/loadavg)"
        python -m engine.cli bench latency --backend engine --batch-size 1 --model "$G" --input-len 128 \
            --output-len 128 --num-iters 3 --num-threads "$THREADS" --disable-tqdm --cpu-gguf-activations "$kind" ${EXTRA:-} \
            --output-json "$OUT/engine-$kind-$i.json" > /dev/null 2>&1
    done
    echo "== round $i: llama.cpp, load $(cut -d' ' -f1 /proc/loadavg)"
    "$LLAMA_BENCH" -m "$G" -t "$THREADS" -p 0 -n 128 -d 128 -r 3 -o json > "$OUT/llamacpp-$i.json" 2>/dev/null
done
python - "$OUT" "$ROUNDS" "$KINDS" <<'PY'
import json, statistics, sys
out, rounds, kinds = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
rows = []
for i in range(1, rounds + 1):
    llama = json.load(open(f"{out}/llamacpp-{i}.json"))[0]["avg_ts"]
    row = {"round": i, "llamacpp_tok_s": round(llama, 2)}
    for kind in kinds:
        e = json.load(open(f"{out}/engine-{kind}-{i}.json"))
        tok_s = 1000.0 / e["results"][0]["tpot"]["median_ms"]
        row[kind] = {"tok_s": round(tok_s, 2), "ratio": round(tok_s / llama, 3), "load": e["environment"]["load_average"][0]}
    rows.append(row)
    print(f"round {i}: llama.cpp {llama:6.1f} tok/s; " + "; ".join(
        f"pagewise {k} {row[k]['tok_s']:6.1f} ({row[k]['ratio']:.3f}x)" for k in kinds))
summary = {"rounds": rows, "median_llamacpp": statistics.median(r["llamacpp_tok_s"] for r in rows)}
for kind in kinds:
    med = statistics.median(r[kind]["tok_s"] for r in rows)
    ratios = [r[kind]["ratio"] for r in rows]
    summary[kind] = {"median_tok_s": med, "ratio_of_medians": med / summary["median_llamacpp"],
                     "median_ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)]}
    print(f"{kind}: median {med:.1f} tok/s, {med / summary['median_llamacpp']:.3f}x llama.cpp's median; "
          f"per-round ratios {min(ratios):.3f}-{max(ratios):.3f}, median {statistics.median(ratios):.3f}")
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
PY
