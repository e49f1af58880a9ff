#!/bin/bash
# The default model's 64 x 128/128 offline throughput (`engine bench throughput`, the default dtype
# and file) on a quiet machine, then beside one busy loop per CPU with the default thread count (the
# LoadFollower) and each fixed --num-threads 1..4, twice in that order: whether the default keeps
# >= 0.4x of its quiet throughput and never falls below one thread (the shared-CPU bar), and what the fixed
# counts would give instead. JSON and logs per run in OUT; a line per run on stdout.
#   bash benchmarks/threads/busy_thread_counts.sh benchmarks/threads/s18
set -u
G=$(python -c "from engine.loading.default_model import default_gguf_path; print(default_gguf_path())")
OUT=$1; mkdir -p "$OUT"
JOB="--backend engine --model $G --num-prompts 64 --input-len 128 --output-len 128 --disable-tqdm"
run() { local label=$1; shift
  python -m engine bench throughput $JOB "$@" --output-json "$OUT/$label.json" >"$OUT/$label.log" 2>&1
  python - "$OUT/$label.json" "$label" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["results"][0]
print(f"{sys.argv[2]:20s} output tok/s {r['metrics']['output_tokens_per_s']:8.1f}  "
      f"load {open('/proc/loadavg').read().split()[0]}", flush=True)
PY
}
for i in 1 2; do run quiet-$i; done
for _ in $(seq "$(nproc)"); do python -c "while True: pass" & done; sleep 2
for i in 1 2; do
  for t in default 1 2 3 4; do
    if [ $t = default ]; then run busy-default-$i; else run busy-t$t-$i --num-threads $t; fi
  done
done
kill $(jobs -p) 2>/dev/null; wait 2>/dev/null
