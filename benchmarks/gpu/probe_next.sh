#!/usr/bin/env bash
# Prepared in session 20 (no device time left) for the next lease: where the one-row int4 kernel
# spends its time (Nsight Compute), and the lab kernel on int8 activations and dp4a
# (gemv_dp4a.py: its check against the oracle on a 1B layer's shapes, then its tiles timed against
# the engine's gemv_kernel, CUDA graphs over weight copies beyond L2). Output under $OUT.
set -u
source benchmarks/gpu/lease_env.sh
t0=$(date +%s)
timeout ${LAB_S:-150} python3 benchmarks/gpu/gemv_dp4a.py --output-json "$OUT/dp4a.json" 2>&1 | tee "$OUT/dp4a.log"
echo "== lab done at $(( $(date +%s) - t0 )) s"
NCU_S=${NCU_S:-90} bash benchmarks/gpu/ncu_gemv.sh
echo "== ncu done at $(( $(date +%s) - t0 )) s"
