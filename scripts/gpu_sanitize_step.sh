#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over one B = 8 step of the batched engine (issue #16's
# evidence): scripts/gpu_sanitize_step.py under each tool, no caching allocator (so an access past
# a tensor lands outside any allocation), every kernel checked. Logs: $OUT/sanitize-<tool>.log.
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
# racecheck runs the --light step (no warm-up launches, one step): it is ~10x slower than memcheck;
# LAYERS (e.g. 2,1) shrinks the model to that many talker / code-predictor layers (same kernels)
for tool in ${TOOLS:-memcheck racecheck}; do
  light="$([ $tool = racecheck ] && echo --light) ${LAYERS:+--layers $LAYERS} ${SPP:+--spp $SPP}"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${SAN_TIMEOUT:-240}" compute-sanitizer --tool $tool \
    --error-exitcode 9 ${SAN_ARGS:-} $PY scripts/gpu_sanitize_step.py $light >"$OUT/sanitize-$tool.log" 2>&1
  echo "$tool rc=$? :: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sanitize step ok' "$OUT/sanitize-$tool.log" | tr '\n' ' ')"
done
