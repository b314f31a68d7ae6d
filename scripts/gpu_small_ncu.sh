#!/usr/bin/env bash
# Where the small-batch kernel's code-predictor launch and the draw between two of them spend their
# cycles at B = 1 (issue 16: a layer's four hops take ~4.4 µs each against ~1.6 µs of weights, and
# a product's mma chain ~40 cycles a step inside the kernel against ~25 alone): Nsight Compute on one
# launch of each kernel inside gpu_small_timeline.py's frame replays (the engine's frame graphs), with
# the warp states, the scheduler and the source counters (stall samples per SASS instruction), the
# source page exported per instruction. Firecracker machines need --clock-control none. Results:
# $OUT/ncu-<name>.{ncu-rep,txt,log} and $OUT/ncu-<name>-sass.csv. KERNELS: "name=regex" words over
# the demangled names; SKIP: launches of each skipped first, COUNT: launches profiled. The timeline
# script runs with --replays-only (the torch profiler cannot share CUPTI with ncu: session 47's
# first run died there).
#   bash scripts/gpu_small_ncu.sh
source "$(dirname "$0")/gpu_env.sh"
make -s -C csrc libqwen_small.so libqwen_attn.so > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
for kv in ${KERNELS:-cp=cp_layers_kernel draw=_sample_kernel}; do
  name=${kv%%=*} rep="$OUT/ncu-${kv%%=*}"
  timeout "${NCU_TIMEOUT:-280}" ncu --clock-control none --kernel-name-base demangled -k "regex:${kv#*=}" \
    --launch-skip "${SKIP:-40}" --launch-count "${COUNT:-1}" --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section SchedulerStats --section SourceCounters --section LaunchStats \
    -o "$rep" -f $PY scripts/gpu_small_timeline.py --modes on --sizes 1 --replays-only --out "/tmp/ncu-tl-$name" \
    > "$rep.log" 2>&1
  echo "ncu $name rc $?"; grep -E "==ERROR==|==WARNING==" "$rep.log" | head -3
  [ -f "$rep.ncu-rep" ] || continue
  ncu -i "$rep.ncu-rep" --page details > "$rep.txt" 2>&1
  grep -E "Duration|Registers Per|Issued Warp|No Eligible|Eligible Warps|Active Warps|Stall|Warp Cycles" "$rep.txt" | head -24
  ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$rep-sass.csv" 2> "$rep-sass.err" \
    || echo "source page: $(head -2 "$rep-sass.err")"
done
