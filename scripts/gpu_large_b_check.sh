#!/usr/bin/env bash
# scripts/gpu_large_b_sweep.py in one GPU call; then (CHECK=1) the engine's invariance and
# teacher-forced sections and the frame times with the tree's settings. Results: $OUT/large_b.tar.gz.
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
R=$OUT/r; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$R/env.txt"
OUT=$R timeout ${SWEEP_TIMEOUT:-400} $PY scripts/gpu_large_b_sweep.py --sections ${SECTIONS:-cp_first,cp_attend,gemm} 2>&1 \
  | tee "$R/sweep.log" | grep -v Warn | tail -60
if [ -n "${CHECK:-}" ]; then
  timeout 200 $PY scripts/gpu_batched_engine.py --out "$R" --sections invariance,teacher_forced 2>&1 \
    | tee "$R/engine.log" | grep -E "==|greedy|sampled|bf16_kv|fp32_kv|Error|error" | cut -c1-300
  timeout 200 $PY scripts/gpu_frame_profile.py --out "$R" --sections frames,profile 2>&1 | tee "$R/frames.log" \
    | grep -E "ms$|profile B|Error" | head -40
fi
tar czf "$OUT/large_b.tar.gz" -C "$R" .
