# Sourced by the GPU-machine scripts (gpu_kernel_check.sh, kernel_variants.sh, profile_kernel.sh,
# run_bench_gpu.sh): repo root as the working directory, $OUT for results, unbuffered Python, and
# the wheels carried in .whl/ (packages the GPU image lacks) installed into /tmp/site.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)  # this file is in scripts/
cd "$ROOT"
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
