#!/usr/bin/env bash
# Why the talker's decode attention moves ~2.7 TB/s at B = 64 (1.36 ms of a 4.68 ms frame on an
# H200, session 42) where the same page walk loading K/V only reached 2.9 and B = 256's 3.7:
# Nsight Compute on gpu_attn_probe.py's B = 64 mixed case (its first section), one launch each of
# the split kernel and of the loads-only kernel after their warm-ups: speed of light, memory
# workload, occupancy, warp states, scheduler, launch. Firecracker machines need
# --clock-control none. Results: $OUT/ncu-$NAME-*.{ncu-rep,txt}. Other kernels and another probe:
# KERNELS (names, regexes), PROBE (the script and its arguments), SKIP (launches of each kernel
# before the profiled one), NAME, MORE_SECTIONS (e.g. "--section SourceCounters");
# gpu_attn_persist_ncu.sh is one.
#   bash scripts/gpu_attn_ncu.sh
source "$(dirname "$0")/gpu_env.sh"
NAME=${NAME:-attn}
for k in ${KERNELS:-_attn_split_tc_kernel _loads_only_kernel}; do
  rep="$OUT/ncu-$NAME-$k"
  # shellcheck disable=SC2086  # (PROBE and MORE_SECTIONS are word lists)
  timeout "${NCU_TIMEOUT:-240}" ncu --clock-control none -k "regex:$k" --launch-skip "${SKIP:-3}" --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
    --section SchedulerStats --section LaunchStats ${MORE_SECTIONS:-} -o "$rep" -f \
    $PY ${PROBE:-scripts/gpu_attn_probe.py --sections decode --out /tmp/attn-ncu} > "$rep.log" 2>&1
  echo "ncu $k rc $?"; grep -E "==ERROR==|==WARNING==" "$rep.log" | head -3
  if [ -f "$rep.ncu-rep" ]; then
    ncu -i "$rep.ncu-rep" --page details > "$rep.txt" 2>&1
    grep -E "Grid Size|Block Size|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Shared Memory Config|No Eligible|Issued Warp|Eligible Warps|Active Warps|Stall|L2 Hit" \
      "$rep.txt" | head -30
  fi
done
