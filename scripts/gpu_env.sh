# Sourced by the GPU-machine scripts (gpu_kernel_check.sh, kernel_variants.sh, profile_kernel.sh,
# run_bench_gpu.sh): repo root as the working directory, $OUT for results, unbuffered Python, and
# the wheels carried in .whl/ (packages the GPU image lacks) installed into /tmp/site, and a Triton
# cache carried in .triton-cache/cache.tgz (an earlier call's `save_triton_cache`) unpacked into
# TRITON_CACHE_DIR, so that a fresh machine does not compile every kernel again (a server start
# spent 110-195 s compiling). Triton keys each kernel by its source, options and toolchain, so a
# changed kernel compiles afresh and a stale entry is never used.
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
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
if [ -f .triton-cache/cache.tgz ] && [ ! -e "$TRITON_CACHE_DIR/.seeded" ]; then
  mkdir -p "$TRITON_CACHE_DIR" && tar -xzf .triton-cache/cache.tgz -C "$TRITON_CACHE_DIR" \
    && touch "$TRITON_CACHE_DIR/.seeded" && echo "triton cache: $(ls "$TRITON_CACHE_DIR" | wc -l) entries carried"
fi
# the Triton cache as $OUT/triton-cache.tgz, to carry into the next call (.triton-cache/cache.tgz)
save_triton_cache() {  # the compiled kernels and their metadata only (Triton loads what a group lists and has)
  tar -czf "$OUT/triton-cache.tgz" --exclude=.seeded --exclude='*.ttir' --exclude='*.ttgir' --exclude='*.llir' \
      --exclude='*.ptx' --exclude='*.source' -C "$TRITON_CACHE_DIR" . \
    && echo "triton cache: $(ls "$TRITON_CACHE_DIR" | wc -l) entries, $(du -h "$OUT/triton-cache.tgz" | cut -f1) packed"
}
