#!/usr/bin/env bash
# Where the persistent decode attention split (v2, csrc/attn/decode_split.cuh) spends what its walk
# alone does not (H200, B = 64 mixed: 39.5 against 33.5 µs): Nsight Compute on one launch each of the
# Triton split, v2 and the loads-only walk (gpu_attn_persist.py --profile), with the SASS and its stall
# samples for v2. Firecracker machines need --clock-control none. Results: $OUT/ncu-persist-*.
#   bash scripts/gpu_attn_persist_ncu.sh
source "$(dirname "$0")/gpu_env.sh"
for k in _attn_split_tc_kernel attn_persist_v2_kernel attn_persist_kernel; do
  timeout "${NCU_TIMEOUT:-240}" ncu --clock-control none -k "regex:$k" --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
    --section SchedulerStats --section LaunchStats --section SourceCounters -o "$OUT/ncu-persist-$k" -f \
    $PY scripts/gpu_attn_persist.py --profile --out /tmp/persist-ncu > "$OUT/ncu-persist-$k.log" 2>&1
  echo "ncu $k rc $?"; grep -E "==ERROR==" "$OUT/ncu-persist-$k.log" | head -3
  if [ -f "$OUT/ncu-persist-$k.ncu-rep" ]; then
    ncu -i "$OUT/ncu-persist-$k.ncu-rep" --page details > "$OUT/ncu-persist-$k.txt" 2>&1
    grep -E "Duration|DRAM Throughput|Achieved Occupancy|Registers Per|No Eligible|Issued Warp|Eligible Warps|Active Warps" \
      "$OUT/ncu-persist-$k.txt" | head -12
  fi
done
ncu -i "$OUT/ncu-persist-attn_persist_v2_kernel.ncu-rep" --page source --csv --print-source sass \
  > "$OUT/ncu-persist-v2-sass.csv" 2>/dev/null && gzip -f "$OUT/ncu-persist-v2-sass.csv"
