#!/bin/bash
# Throughput of the default model's Q4_1 file beside ONE busy loop (other CPUs free: a single-threaded
# job on a 2-CPU machine), BEFORE and MAIN checkouts (git worktrees) with their default threads and
# MAIN with --num-threads 1, ROUNDS rounds in turn; `engine bench throughput` 64 x 128/128.
#   benchmarks/threads/one_busy_loop.sh BEFORE MAIN OUT [ROUNDS]
set -u
BEFORE=$1 MAIN=$2 OUT=$(cd "$3" && pwd) ROUNDS=${4:-3}
G=$(python -c "from engine.loading.default_model import default_gguf_path; print(default_gguf_path())")
JOB="--backend engine --model $G --num-prompts 64 --input-len 128 --output-len 128 --disable-tqdm"
python -c "while True: pass" &
BUSY=$!
sleep 2
for r in $(seq "$ROUNDS"); do
  for side in before main one; do
    dir=$MAIN extra=""
    [ $side = before ] && dir=$BEFORE
    [ $side = one ] && extra="--num-threads 1"
    (cd "$dir" && python -m engine bench throughput $JOB $extra --output-json "$OUT/$side-$r.json" > "$OUT/$side-$r.log" 2>&1)
    python -c "import json; print('$r $side', round(json.load(open('$OUT/$side-$r.json'))['results'][0]['metrics']['output_tokens_per_s'], 1), 'load', open('/proc/loadavg').read().split()[0])"
  done
done
kill $BUSY
