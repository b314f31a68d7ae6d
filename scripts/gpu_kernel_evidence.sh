#!/usr/bin/env bash
# The batched kernels inside the engine (frame_kernel="cuda"): scripts/gpu_batched_engine.py's
# correctness and memory sections (teacher-forced fidelity inside B = 64, greedy codes vs the torch
# engine, invariance) and the suite's GPU tests of csrc/batched. Under $OUT.
source "$(dirname "$0")/gpu_env.sh"
make -C csrc libqwen_batched.so > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
timeout "${ENGINE_TIMEOUT:-300}" $PY scripts/gpu_batched_engine.py --frame-kernel cuda --out "$OUT/engine" \
  --budget-s 240 --sections "${ENGINE_SECTIONS:-invariance,memory,teacher_forced,greedy_vs_torch}" > "$OUT/engine.log" 2>&1
echo "engine rc=$?"; grep -vE "^\s*$" "$OUT/engine.log" | tail -40 | cut -c1-400
timeout "${PYTEST_TIMEOUT:-200}" $PY -m pytest -q -m gpu tests/test_batched_kernel.py -p no:cacheprovider 2>&1 | tail -8
