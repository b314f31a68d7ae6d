#!/usr/bin/env bash
# Session 43's prepared work in one device call: the persistent decode attention split in the engine
# (csrc/attn/, attn_kernel.py). Carry .whl, .triton-cache and .base, where .base is the tree before
# it (`rm -rf .base && mkdir .base && git archive a053222 tts_server csrc | tar -x -C .base && cp -r
# scripts .base/`):
#   1. this tree's libqwen_small.so and libqwen_attn.so, the base's libqwen_small.so
#   2. tests/test_attn_kernel.py and tests/test_batched_engine.py on the GPU (first, in the A/B's call)
#   3. gpu_frames_ab.sh, base (the Triton split) vs this tree (the persistent split): B = 1-256 frames,
#      2 rounds, the frames' signatures compared, each engine's kernels named in its log ("engine: ")
#   4. with NCU=1: gpu_attn_persist_ncu.sh (Nsight Compute on the Triton split, v2 and the walk alone
#      at B = 64), packed as $OUT/ncu.tgz
#   5. with SANITIZE=1: compute-sanitizer memcheck and racecheck on the kernel's start-up check
#      (attn_kernel.check: 16, 64 and 256 rows; the shared-memory stages are reused across items)
# Steps 2-3 take ~7 minutes, so run 4-5 in a second call: AB=0 NCU=1 SANITIZE=1. PRE_TESTS and SIZES
# replace step 2's tests and step 3's batch sizes.
# Results: $OUT/logs.tgz (the builds, tests and rounds' logs), rounds.tar.gz, ncu.tgz, triton-cache.tgz.
source "$(dirname "$0")/gpu_env.sh"
export TTS_ATTN_KERNEL=1  # (the default since session 44; the base tree has no such kernel)
make -s -C csrc libqwen_small.so libqwen_attn.so > "$OUT/build.log" 2>&1 || tail -5 "$OUT/build.log"
make -s -C "${BASE:-.base}/csrc" libqwen_small.so > "$OUT/build-base.log" 2>&1 || tail -3 "$OUT/build-base.log"
if [ "${AB:-1}" = 1 ]; then
  PRE_TESTS=${PRE_TESTS-"tests/test_attn_kernel.py tests/test_batched_engine.py"} TEST_TIMEOUT=300 DIGEST=0 \
    ROUNDS=2 SIZES=${SIZES:-1,16,32,64,128,256} RUN_TIMEOUT=150 COMMIT=attn-kernel bash scripts/gpu_frames_ab.sh 2>&1 \
    | grep -E "==|mixed|differ|rc|engine: " | tail -40
  tail -3 "$OUT/tests.log"
fi
if [ "${NCU:-0}" = 1 ]; then
  mkdir -p "$OUT/ncu" && OUT="$OUT/ncu" bash scripts/gpu_attn_persist_ncu.sh
  tar -czf "$OUT/ncu.tgz" -C "$OUT" ncu && rm -rf "$OUT/ncu"
fi
if [ "${SANITIZE:-0}" = 1 ]; then
  for tool in memcheck racecheck; do
    PYTHONPATH=$ROOT timeout 300 compute-sanitizer --tool $tool --kernel-name kns=attn_persist_v2 $PY -c \
      "import torch; from tts_server.engines.batched import attn_kernel as a; print('check:', a.check(a.DecodeSplit(torch.device('cuda', 0))))" \
      > "$OUT/sanitize-$tool.log" 2>&1
    echo "sanitize $tool rc $?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|check:" "$OUT/sanitize-$tool.log" | head -4
  done
fi
(cd "$OUT" && tar -czf logs.tgz ./*.log ./env.txt 2>/dev/null; rm -f ./*.log ./env.txt)  # the tool returns <= 8 files
save_triton_cache
