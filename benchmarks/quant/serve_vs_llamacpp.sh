#!/usr/bin/env bash
# `engine bench serve` on the default model's Q4_1 file, pagewise against llama-server, in rounds that
# alternate which server goes first (this machine's speed moves 20-40% within minutes, so one run of
# each is not a comparison; decode_vs_llamacpp.sh does the same for batch 1). Each round is one
# `engine bench serve --launch A,B` (a fresh server each, 64 requests of 128 random prompt tokens and
# 128 output tokens per concurrency in CONCURRENCY, EOS ignored, the client on the same cores), A/B
# = engine,llamacpp on odd rounds and llamacpp,engine on even ones.
# JSON per round: $OUT/serve-N.json; the summary (each round's output tok/s, ratios and load, the
# median ratio per concurrency) is printed and written to $OUT/summary.json.
# EXTRA: more flags for pagewise's server and the client, e.g. "--kv-cache-dtype float16".
set -eu
G=${MODEL:-$(python -c "from engine.loading.default_model import default_gguf_path; print(default_gguf_path())")}
ROUNDS=${ROUNDS:-3}
CONCURRENCY=${CONCURRENCY:-8,32}
PROMPTS=${PROMPTS:-64}
LLAMA_SERVER=${LLAMA_SERVER:-/opt/llamacpp/bin/llama-server}
OUT=${OUT:-benchmarks/quant/serve-vs-llamacpp}
mkdir -p "$OUT"
for i in $(seq 1 "$ROUNDS"); do
    order=$([ $((i % 2)) = 1 ] && echo engine,llamacpp || echo llamacpp,engine)
    echo "== round $i: $order, load $(cut -d' ' -f1 /proc/loadavg)"
    python -m engine.cli bench serve --launch "$order" --llamacpp-server "$LLAMA_SERVER" --model "$G" \
        --max-concurrency "$CONCURRENCY" --num-prompts "$PROMPTS" --random-input-len 128 --random-output-len 128 \
        --disable-tqdm ${EXTRA:-} --output-json "$OUT/serve-$i.json" > "$OUT/serve-$i.txt" 2>&1
done
python - "$OUT" "$ROUNDS" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
rows, ratios = [], {}
for i in range(1, rounds + 1):
    d = json.load(open(f"{out}/serve-{i}.json"))
    tok_s = {(r["server"], r["max_concurrency"]): r["metrics"]["output_throughput"] for r in d["runs"]}
    row = {"round": i, "order": list(d["servers"]), "load": d["environment"]["load_average"]}
    for c in sorted({c for _, c in tok_s}):
        e, l = tok_s[("engine", c)], tok_s[("llamacpp", c)]
        row[f"c{c}"] = {"engine_tok_s": round(e, 1), "llamacpp_tok_s": round(l, 1), "ratio": round(e / l, 3)}
        ratios.setdefault(c, []).append(e / l)
    rows.append(row)
    print(f"round {i} ({','.join(row['order'])}): " + "; ".join(
        f"c={c} pagewise {row[f'c{c}']['engine_tok_s']} / llama-server {row[f'c{c}']['llamacpp_tok_s']} tok/s "
        f"= {row[f'c{c}']['ratio']:.2f}x" for c in ratios))
summary = {"rounds": rows, "median_ratio": {c: statistics.median(r) for c, r in ratios.items()},
           "ratio_range": {c: [min(r), max(r)] for c, r in ratios.items()}}
for c, r in ratios.items():
    print(f"c={c}: median ratio {statistics.median(r):.2f}x, range {min(r):.2f}-{max(r):.2f}")
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
PY
