#!/usr/bin/env bash
# The batched frame kernels' evidence in one GPU call (csrc/batched/): build them, run the smoke
# test alone (if it fails, again under compute-sanitizer memcheck, whose report is kept), then
# correctness against the Triton halves, invariance and timing (scripts/gpu_cuda_frame.py), and
# with SANITIZE=1 memcheck + racecheck on one B = 8 frame with 2 talker / 1 code-predictor layers
# (scripts/gpu_sanitize_frame.py). Under $OUT.
#   SECTIONS=smoke,vs_triton,invariance,bench   which sections of gpu_cuda_frame.py
#   SANITIZE=1                                  also memcheck + racecheck (slow: a call of its own)
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/env.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/env.txt"
make -C csrc libqwen_batched.so 2>&1 | tail -20 | tee "$OUT/build.log" || exit 1
if ! $PY scripts/gpu_cuda_frame.py --out "$OUT" --sections smoke > "$OUT/smoke.log" 2>&1; then
  tail -40 "$OUT/smoke.log"
  echo "== smoke failed: compute-sanitizer memcheck"
  compute-sanitizer --tool memcheck --print-limit 20 $PY scripts/gpu_cuda_frame.py --out "$OUT/san" --sections smoke \
    > "$OUT/memcheck.log" 2>&1
  grep -v "^\[" "$OUT/memcheck.log" | head -80
  exit 1
fi
cat "$OUT/smoke.log"
$PY scripts/gpu_cuda_frame.py --out "$OUT" --sections "${SECTIONS:-vs_triton,invariance,bench}" 2>&1 | tee "$OUT/cuda_frame.log"
if [ "${SANITIZE:-0}" = 1 ]; then
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --print-limit 20 $PY scripts/gpu_sanitize_frame.py > "$OUT/$tool.log" 2>&1
    echo "== $tool: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/$tool.log" | tail -1)"
  done
fi
