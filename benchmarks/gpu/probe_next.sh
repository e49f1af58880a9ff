#!/usr/bin/env bash
# Prepared in sessions 20 and 24 (no device time either) for the next lease: why the one-row int4
# kernel reads at a third of HBM's bandwidth. Three probes, output under $OUT:
#  - gemv_tiled.py: the same arithmetic on a layout with each program's step contiguous (memory
#    pages), and the engine's kernel at 1-2 warps and 128-256 columns (more, smaller programs);
#  - gemv_dp4a.py: int8 activations and dp4a (fewer instructions a word of codes);
#  - Nsight Compute on gemv_kernel (stall reasons: memory or issue).
# Each checks itself against float64 first. About 8 minutes; the timeouts keep it under 10.
set -u
source benchmarks/gpu/lease_env.sh
t0=$(date +%s)
timeout ${TILED_S:-200} python3 benchmarks/gpu/gemv_tiled.py --output-json "$OUT/tiled.json" 2>&1 | tee "$OUT/tiled.log"
echo "== tiled done at $(( $(date +%s) - t0 )) s"
timeout ${LAB_S:-150} python3 benchmarks/gpu/gemv_dp4a.py --output-json "$OUT/dp4a.json" 2>&1 | tee "$OUT/dp4a.log"
echo "== dp4a done at $(( $(date +%s) - t0 )) s"
NCU_S=${NCU_S:-90} bash benchmarks/gpu/ncu_gemv.sh
echo "== ncu done at $(( $(date +%s) - t0 )) s"
