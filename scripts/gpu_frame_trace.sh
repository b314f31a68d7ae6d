#!/usr/bin/env bash
# The batched frame kernels' barrier trace (scripts/gpu_frame_trace.py) and, with NCU=1, Nsight
# Compute's speed-of-light, warp-state and memory sections of one predict and one advance launch
# at B = ${NCU_B:-1}. Under $OUT.
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
make -C csrc libqwen_batched.so > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
timeout "${TRACE_TIMEOUT:-200}" $PY scripts/gpu_frame_trace.py --out "$OUT" --sizes "${SIZES:-1,8,64,256}" --variants "${VARIANTS:-}" 2>&1 | tee "$OUT/trace.log"
if [ -n "${ALT_DEFS:-}" ]; then  # the same trace of a variant build: ALT_DEFS="-DSOME_SWITCH=1" for a switch under test
  mkdir -p csrc/build "$OUT/alt"
  make -C csrc BATCHED_LIB=build/alt.so DEFS="$ALT_DEFS" build/alt.so > "$OUT/alt/build.log" 2>&1 || { tail -30 "$OUT/alt/build.log"; exit 1; }
  echo "== variant $ALT_DEFS"
  QBK_LIB="$PWD/csrc/build/alt.so" timeout "${TRACE_TIMEOUT:-200}" $PY scripts/gpu_frame_trace.py --out "$OUT/alt" \
    --sizes "${SIZES:-1,8,64,256}" 2>&1 | tee "$OUT/alt/trace.log"
fi
if [ "${NCU:-0}" = 1 ]; then
  for k in predict advance; do
    timeout 150 ncu --clock-control none -k "regex:qbk_${k}" --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \
      $PY scripts/gpu_frame_trace.py --out "$OUT/ncu" --sizes "${NCU_B:-1}" > "$OUT/ncu_$k.log" 2>&1
    echo "== ncu $k"
    grep -E "Duration|Throughput|Stall|Warp Cycles|Issued|Hit Rate|Mem Busy|Max Bandwidth|DRAM" "$OUT/ncu_$k.log" | head -40
  done
fi
