#!/bin/bash
# The load-following thread count (engine/runner/cpu_threads.py, LoadFollower) against the bounded spin
# alone, under one busy loop per CPU and as two engines side by side; the default model's float
# folder in float32 (the engine's CPU default). BEFORE and AFTER are checkouts, as in shared_cpus.sh:
#   benchmarks/threads/probing_vs_spin.sh /tmp/before /work/main benchmarks/threads/s8
set -u
BEFORE=$1 AFTER=$2 OUT=$3
JOB="--backend engine --dtype float32 --num-prompts 64 --input-len 128 --output-len 128 --disable-tqdm"
run() {  # label checkout [extra args]
  local label=$1 dir=$2; shift 2
  (cd "$dir" && python -m engine bench throughput $JOB "$@" --output-json "$OUT/$label.json" > "$OUT/$label.log" 2>&1)
  python - "$OUT/$label.json" "$label" <<'PY'
import json, sys
tok = json.load(open(sys.argv[1]))["results"][0]["metrics"]["output_tokens_per_s"]
print(f"{sys.argv[2]:28s} output tok/s {tok:8.1f}  load {open('/proc/loadavg').read().split()[0]}")
PY
}
OUT=$(cd "$OUT" && pwd)
run quiet-probing-1 "$AFTER"
for _ in $(seq "$(nproc)"); do python -c "while True: pass" & done; sleep 2
run busy-probing-1 "$AFTER"; run busy-before-4 "$BEFORE"; run busy-probing-2 "$AFTER"
kill $(jobs -p) 2>/dev/null; wait 2>/dev/null
run pair-probing-a "$AFTER" & run pair-probing-b "$AFTER"; wait
