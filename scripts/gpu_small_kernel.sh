#!/usr/bin/env bash
# Issue 16's small-batch kernel on a GPU (csrc/small/, tts_server/engines/batched/small_kernel.py):
# build libqwen_small.so; its layers checked bitwise against the Triton launches, as a replayed
# CUDA graph and across its epoch's wrap, and timed (gpu_cp_layer_engine.py, MS rows); the GPU test
# of the engine serving steps of one stream with it (tests/test_small_kernel.py); then,
# when BASE holds a tree without it, a same-call A/B of the frames (gpu_frames_ab.sh, SIZES).
#   BASE=.base SIZES=1,2,4,16 ROUNDS=2 bash scripts/gpu_small_kernel.sh
source "$(dirname "$0")/gpu_env.sh"
make -s -C csrc libqwen_small.so > "$OUT/build.log" 2>&1
echo "build rc $?"; grep -E "error|registers|spill" "$OUT/build.log" | head -5
timeout "${LAYERS_TIMEOUT:-240}" $PY scripts/gpu_cp_layer_engine.py --only-ll --out "$OUT" --ms ${MS:-1} > "$OUT/layers.log" 2>&1
echo "layers rc $?"; grep -E "bits|µs per layer|serving kernel|Error|error" "$OUT/layers.log" | head -30
PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} timeout "${TEST_TIMEOUT:-300}" $PY -m pytest -q -m gpu \
  tests/test_small_kernel.py ${MORE_TESTS:-} -p no:cacheprovider > "$OUT/tests.log" 2>&1
echo "tests rc $?"; tail -15 "$OUT/tests.log"
if [ -d "${BASE:-.base}" ]; then
  SIZES=${SIZES:-1,2,4,16} DIGEST=${DIGEST:-0} bash scripts/gpu_frames_ab.sh > "$OUT/ab.log" 2>&1
  echo "frames A/B rc $?"; tail -25 "$OUT/ab.log"
fi
save_triton_cache
