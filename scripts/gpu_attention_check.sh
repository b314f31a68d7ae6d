#!/usr/bin/env bash
# The decode attention's evidence in one GPU call: scripts/gpu_frame_profile.py (attention variants,
# frame time with each, per-kernel profile), the batched-ops GPU tests, and the engine's invariance
# and teacher-forced sections of scripts/gpu_batched_engine.py. Results: $OUT/attention.tar.gz.
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
R=$OUT/r; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$R/env.txt"
git rev-parse --short HEAD >> "$R/env.txt" 2>/dev/null
timeout ${PROFILE_TIMEOUT:-330} $PY scripts/gpu_frame_profile.py --out "$R" --sections ${SECTIONS:-attention,frames,profile} 2>&1 | tee "$R/profile.log" | grep -v Warning | tail -80
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 150 $PY -m pytest -q -m gpu tests/test_batched_ops.py -p no:cacheprovider 2>&1 | tail -5 | tee "$R/pytest.log"
  timeout ${ENGINE_TIMEOUT:-200} $PY scripts/gpu_batched_engine.py --out "$R" --sections ${ENGINE_SECTIONS:-invariance,teacher_forced} 2>&1 \
    | tee "$R/engine.log" | grep -E "==|greedy|sampled|bf16_kv|fp32_kv|ctx mixed|profile B|Error|error" | cut -c1-300
fi
tar czf "$OUT/attention.tar.gz" -C "$R" .
