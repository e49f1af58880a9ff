#!/usr/bin/env bash
# Nsight Compute on the one-row packed int4 matmul (kernels/triton_quant_packed.py gemv_kernel), the
# kernel that keeps batch-1 int4 decode at 1.19x bf16 (BENCHMARKS.md, "GPU"): is it issue-bound
# (the estimate) or waiting on memory? One launch after three, per shape: a 1B layer's gate_up and o.
# Run from the repository root on the device machine; reports under $OUT (text, and .ncu-rep files).
set -u
source benchmarks/gpu/device_env.sh
sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
--section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section InstructionStats"
for shape in 16384x2048 2048x2048; do
    timeout ${NCU_S:-120} ncu --kernel-name regex:gemv_kernel --launch-skip 3 --launch-count 1 $sections \
        --export "$OUT/gemv-$shape" --force-overwrite python3 benchmarks/gpu/gemv_once.py --shape $shape \
        >"$OUT/ncu-$shape.txt" 2>&1
    echo "== $shape rc=$?"
    grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Registers Per|Achieved Occupancy|Stall|No Eligible|Executed Ipc" \
        "$OUT/ncu-$shape.txt" | head -30
done
