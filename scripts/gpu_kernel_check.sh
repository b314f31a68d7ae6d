#!/usr/bin/env bash
# Megakernel evidence in one call on a CUDA machine: build, compute-sanitizer (memcheck + racecheck
# on one frame), correctness (teacher forced + greedy parity + sampling) and the benchmark.
# Logs and kernel_results.json land in $OUT; a short table is printed last.
#   STAGES="build sanitize check bench" (default: all)   FRAMES=200   GREEDY_FRAMES=40   VARIANTS=libs
# Wheels for qwen-tts and transformers 4.57.3 (the GPU image has 5.x) may be carried in .whl/.
source "$(dirname "$0")/gpu_env.sh"
STAGES=${STAGES:-"build sanitize check bench"}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/env.txt"

[[ " $STAGES " == *" build "* ]] && make -C csrc 2>&1 | tee "$OUT/build.log" | tail -5

ARGS=()
[[ " $STAGES " == *" check "* ]] && ARGS+=(--check --frames "${FRAMES:-200}" --greedy-frames "${GREEDY_FRAMES:-40}")
[[ " $STAGES " == *" bench "* ]] && ARGS+=(--bench)
# VARIANTS="csrc/build/a.so,csrc/build/b.so": short check + ctx-100 timings of each library
[ -n "${VARIANTS:-}" ] && ARGS+=(--variants "$VARIANTS" --variant-frames "${VARIANT_FRAMES:-16}")
if [ ${#ARGS[@]} -gt 0 ]; then
  timeout "${RUN_TIMEOUT:-330}" $PY scripts/bench_kernel.py "${ARGS[@]}" --out "$OUT" >"$OUT/run.log" 2>&1
  echo "bench_kernel rc=$?"
fi

if [[ " $STAGES " == *" sanitize "* ]]; then
  for tool in memcheck racecheck; do
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${SAN_TIMEOUT:-200}" compute-sanitizer --tool $tool \
      --kernel-name kns=qmk_ $PY scripts/bench_kernel.py --sanitize-frame >"$OUT/$tool.log" 2>&1
    echo "$tool rc=$? :: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sanitize frame ok' "$OUT/$tool.log" | tr '\n' ' ')"
  done
fi
tail -40 "$OUT/run.log" 2>/dev/null
