#!/bin/bash
# Throughput of the default model on a quiet machine and on shared CPUs, before and after the
# thread changes (engine/runner/cpu_threads.py). BEFORE and AFTER are checkouts (git worktrees) of the two
# commits; each run is `engine bench throughput` from that checkout, so each gets its own code.
#   benchmarks/threads/shared_cpus.sh /tmp/before /work/main benchmarks/threads
# DTYPE (default bfloat16) picks the model's dtype; MODEL another model (default: the default model's float32
# folder), e.g. its Q4_1 file; ROUNDS (default 2) the quiet and busy runs of each.
set -u
BEFORE=$1 AFTER=$2 OUT=$3
JOB="--backend engine ${MODEL:+--model $MODEL} --dtype ${DTYPE:-bfloat16} --num-prompts 64 --input-len 128 --output-len 128 --disable-tqdm"
run() {  # label checkout [extra args]
  local label=$1 dir=$2; shift 2
  (cd "$dir" && python -m engine bench throughput $JOB "$@" --output-json "$OUT/$label.json" >"$OUT/$label.log" 2>&1)
  python - "$OUT/$label.json" "$label" <<'PY'
import json, sys
tok = json.load(open(sys.argv[1]))["results"][0]["metrics"]["output_tokens_per_s"]
print(f"{sys.argv[2]:28s} output tok/s {tok:8.1f}  load {open('/proc/loadavg').read().split()[0]}")
PY
}
busy() { for _ in $(seq "$(nproc)"); do python -c "while True: pass" & done; }
OUT=$(cd "$OUT" && pwd)
for i in 1 2; do run quiet-before-$i "$BEFORE"; run quiet-after-$i "$AFTER"; done
busy; sleep 2
for i in $(seq "${ROUNDS:-2}"); do
  run busy-before-$i "$BEFORE"; run busy-after-$i "$AFTER"; run busy-after-1thread-$i "$AFTER" --num-threads 1
done
kill $(jobs -p) 2>/dev/null; wait 2>/dev/null
# Two engines side by side on the same CPUs (a server beside a test run, two tenants).
for side in before after; do
  dir=$BEFORE; [ $side = after ] && dir=$AFTER
  run pair-$side-a "$dir" & run pair-$side-b "$dir"; wait
done
