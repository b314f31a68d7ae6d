#!/usr/bin/env bash
# Session 42's prepared work in one device call (carry .whl and .triton-cache; move
# benchmarks/results aside first only if the tree is over the carry limit):
#   1. the talker attention's CUDA twins against the Triton kernels, bitwise (gpu_attn_twin.py)
#   2. the draw with half the top-k search's reductions (h200-s42/prepared-sampler-4way.diff)
#      against this tree: gpu_frames_ab.sh with BASE = an unpatched copy, this tree patched here
#      (the machine's copy only), and the sampling GPU tests on the patched tree
#   3. Nsight Compute on the B = 64 decode attention (gpu_attn_ncu.sh), if STEPS has 3
# STEPS picks (default "1 2 3").
source "$(dirname "$0")/gpu_env.sh"
STEPS=${STEPS:-1 2 3}
make -s -C csrc libqwen_small.so > "$OUT/build.log" 2>&1 || tail -3 "$OUT/build.log"
if [[ " $STEPS " == *" 1 "* ]]; then
  PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} timeout 240 $PY scripts/gpu_attn_twin.py --out "$OUT/twin" 2>&1 \
    | tail -20
  echo "twin rc ${PIPESTATUS[0]}"
fi
if [[ " $STEPS " == *" 2 "* ]]; then
  rm -rf .base && mkdir .base && cp -r tts_server csrc scripts .base/ && rm -f .base/csrc/*.so
  make -s -C .base/csrc libqwen_small.so > "$OUT/build-base.log" 2>&1 || tail -3 "$OUT/build-base.log"
  patch -p1 < benchmarks/results/h200-s42/prepared-sampler-4way.diff || echo "patch failed"
  PRE_TESTS="tests/test_batched_ops.py tests/test_small_kernel.py" DIGEST=0 ROUNDS=2 SIZES=1,16,64,256 \
    RUN_TIMEOUT=150 COMMIT=prepared-sampler-4way bash scripts/gpu_frames_ab.sh 2>&1 | grep -E "==|mixed|differ|rc" | tail -30
  tail -3 "$OUT/tests.log"
fi
if [[ " $STEPS " == *" 3 "* ]]; then
  bash scripts/gpu_attn_ncu.sh
fi
save_triton_cache
