#!/usr/bin/env bash
# tts-bench on a CUDA machine: a self-started server on the full-size synthetic model, concurrency
# 1/4/16, and the qwen-tts baseline on the same requests at concurrency 1, in one call.
# bench.json, bench.png, bench.log and env.txt land in $OUT; the table and the summary line print last.
#   MODEL=synthetic ENGINE=auto CONCURRENCY=1,4,16 REQUESTS=32 MAX_DURATION=8 BASELINE_REQUESTS=4
#   BUILD_KERNEL=1 (make -C csrc first, so --engine auto can pick the megakernel)
# Wheels missing from the GPU image (qwen-tts, transformers 4.57.3, grpcio-health-checking, ...) may be
# carried in .whl/, as for scripts/gpu_kernel_check.sh.
source "$(dirname "$0")/gpu_env.sh"

export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}

missing=$($PY - <<'EOF'
import importlib.util
names = ["grpc", "google.protobuf", "grpc_health", "grpc_reflection", "numpy", "soundfile", "soxr",
         "torch", "transformers", "qwen_tts", "matplotlib"]
print(" ".join(n for n in names if importlib.util.find_spec(n) is None))
EOF
)
if [ -n "$missing" ]; then
  echo "missing Python packages: $missing (carry their wheels in .whl/)"
  exit 3
fi

if ! nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/env.txt"; then
  echo "no CUDA GPU here; for a CPU run use make bench"
  exit 3
fi
$PY -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' \
  | tee -a "$OUT/env.txt"
if [ "${BUILD_KERNEL:-1}" = 1 ] && command -v nvcc >/dev/null && [ -f csrc/Makefile ]; then
  make -C csrc >"$OUT/build.log" 2>&1
  echo "kernel build rc=$?"
fi

timeout "${RUN_TIMEOUT:-540}" $PY -m tts_client.bench \
  --model "${MODEL:-synthetic}" --engine "${ENGINE:-auto}" \
  --concurrency "${CONCURRENCY:-1,4,16}" --requests "${REQUESTS:-32}" --warmup 2 \
  --max-duration "${MAX_DURATION:-8}" \
  --baseline qwen-tts --baseline-concurrency 1 --baseline-requests "${BASELINE_REQUESTS:-4}" \
  --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log"
rc=${PIPESTATUS[0]}
echo "tts-bench rc=$rc"
exit "$rc"
