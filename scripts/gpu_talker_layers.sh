#!/usr/bin/env bash
# Issue 16, B = 1: the small-batch kernel's talker layers (cp_layers_kernel<true>) in one device
# call: build libqwen_small.so, its GPU tests (the code predictor's path, ABI 4), then
# scripts/gpu_talker_layers.py (bitwise against the Triton launches, graph replays, epoch wrap,
# timing). Carry .whl and .triton-cache. Results: $OUT/talker_layers.json, $OUT/*.txt.
#   bash scripts/gpu_talker_layers.sh
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.txt"
make -s -C csrc libqwen_small.so libqwen_attn.so > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
grep -E "registers|spill" "$OUT/build.log" | head -4
if [ -n "${TESTS-tests/test_small_kernel.py}" ]; then
  timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider ${TESTS-tests/test_small_kernel.py} 2>&1 | tail -3 | tee "$OUT/pytest.txt"
fi
PYTHONPATH=. timeout ${RUN_TIMEOUT:-400} python3 scripts/gpu_talker_layers.py --out "$OUT" ${ARGS:-} 2>&1 | tee "$OUT/talker_layers.txt" | tail -40
