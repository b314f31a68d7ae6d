#!/usr/bin/env bash
# Where the persistent decode attention split (v2, csrc/attn/decode_split.cuh) spends what its walk
# alone does not (H200, B = 64 mixed: 39.5 against 33.5 µs): gpu_attn_ncu.sh on one launch each of
# the Triton split, v2 and the loads-only walk (gpu_attn_persist.py --profile), with the stall
# samples by source line, and v2's SASS with them. Results: $OUT/ncu-persist-*.
#   bash scripts/gpu_attn_persist_ncu.sh
cd "$(dirname "$0")/.." && export OUT=${OUT:-$PWD/out}  # (gpu_attn_ncu.sh sources gpu_env.sh)
NAME=persist KERNELS="_attn_split_tc_kernel attn_persist_v2_kernel attn_persist_kernel" SKIP=2 \
  PROBE="scripts/gpu_attn_persist.py --profile --out /tmp/persist-ncu" MORE_SECTIONS="--section SourceCounters" \
  bash scripts/gpu_attn_ncu.sh
ncu -i "$OUT/ncu-persist-attn_persist_v2_kernel.ncu-rep" --page source --csv --print-source sass \
  > "$OUT/ncu-persist-v2-sass.csv" 2>/dev/null && gzip -f "$OUT/ncu-persist-v2-sass.csv"
