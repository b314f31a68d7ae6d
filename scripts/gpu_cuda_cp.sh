#!/usr/bin/env bash
# The code-predictor kernel's evidence in one GPU call (csrc/batched/): build it, run the smoke
# test alone (if it fails, again under compute-sanitizer memcheck, whose report is kept), then
# correctness, invariance and timing (scripts/gpu_cuda_cp.py). Results under $OUT.
#   SECTIONS=smoke,vs_triton,invariance,bench   which sections of gpu_cuda_cp.py
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/env.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/env.txt"
make -C csrc libqwen_batched.so 2>&1 | tail -20 | tee "$OUT/build.log" || exit 1
if ! $PY scripts/gpu_cuda_cp.py --out "$OUT" --sections smoke > "$OUT/smoke.log" 2>&1; then
  tail -40 "$OUT/smoke.log"
  echo "== smoke failed: compute-sanitizer memcheck"
  compute-sanitizer --tool memcheck --print-limit 20 $PY scripts/gpu_cuda_cp.py --out "$OUT/san" --sections smoke \
    > "$OUT/memcheck.log" 2>&1
  grep -v "^\[" "$OUT/memcheck.log" | head -80
  exit 1
fi
cat "$OUT/smoke.log"
$PY scripts/gpu_cuda_cp.py --out "$OUT" --sections "${SECTIONS:-vs_triton,invariance,bench}" 2>&1 | tee "$OUT/cuda_cp.log"
