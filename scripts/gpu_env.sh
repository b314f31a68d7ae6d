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
save_triton_cache() {  # the kernels' binaries and metadata only: each group file rewritten to list just those
  $PY - "$TRITON_CACHE_DIR" "$OUT/triton-cache.tgz" <<'PYEOF'
import io, json, os, sys, tarfile
src, dst = sys.argv[1:]
keep = (".json", ".cubin")
with tarfile.open(dst, "w:gz") as tar:
    for d in sorted(os.listdir(src)):
        top = os.path.join(src, d)
        if not os.path.isdir(top):
            continue
        for f in sorted(os.listdir(top)):
            path = os.path.join(top, f)
            if f.startswith("__grp__"):
                with open(path) as fh:
                    grp = json.load(fh)
                grp["child_paths"] = {k: v for k, v in grp["child_paths"].items() if k.endswith(keep)}
                data = json.dumps(grp).encode()
                info = tarfile.TarInfo(f"{d}/{f}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            elif f.endswith(keep):
                tar.add(path, f"{d}/{f}")
print(f"triton cache: {len(os.listdir(src))} entries, {os.path.getsize(dst) / 2**20:.1f} MiB packed")
PYEOF
}
# Same-call A/Bs of two trees (gpu_engine_ab.sh, gpu_frames_ab.sh; BASE: the other tree's folder).
# ab_start: the machine and the trees into $OUT/env.txt, then PRE_TESTS (GPU tests of this tree, a
# pytest file list; TEST_TIMEOUT) into $OUT/tests.log. ab_digests: each tree's engine digest
# (interp_engine_digest.py: 8 admissions x 48 frames; equal = the same bits) into
# $OUT/digest-{base,new}.txt; DIGEST=0 skips it.
ab_start() {
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
  echo "base $BASE, new ${COMMIT:-?}" | tee -a "$OUT/env.txt"
  if [ -n "${PRE_TESTS:-}" ]; then
    PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} timeout "${TEST_TIMEOUT:-300}" $PY -m pytest -q -m gpu $PRE_TESTS \
      -p no:cacheprovider > "$OUT/tests.log" 2>&1
    echo "tests rc=$?"; grep -E "passed|failed|error|FAILED|Error" "$OUT/tests.log" | tail -12
  fi
}
ab_digests() {
  [ "${DIGEST:-1}" = 0 ] && return
  local tree dir
  for tree in base new; do
    dir=$([ $tree = base ] && echo "$BASE" || echo .)
    (cd "$dir" && timeout 200 $PY "$ROOT/scripts/interp_engine_digest.py" --device cuda) > "$OUT/digest-$tree.txt" 2>&1
    echo "$tree: $(grep DIGEST "$OUT/digest-$tree.txt" || tail -3 "$OUT/digest-$tree.txt")"
  done
}
