#!/usr/bin/env bash
# Session 44's prepared work in one device call: the persistent decode split's K / V copies under an
# L2 evict_first policy (benchmarks/results/h200-s44/prepared-evict-first.diff, carried as
# .variants/prepared-evict-first.diff: `cp benchmarks/results/h200-s44/prepared-evict-first.diff
# .variants/`). Alone it took v2 at B = 64 from 39.1 to 36.2-37.3 µs a layer and B = 256 at 1,000
# positions from 266 to 272 (gpu_attn_ab.sh); in the frames the merge reads the outputs it keeps in
# L2. This builds the patched tree in /tmp/ef and runs, from it, test_attn_kernel.py (GPU) and
# gpu_frames_ab.sh with BASE = this tree (HEAD): B = SIZES, ROUNDS rounds, signatures compared.
# DIFF: another patch in .variants/ instead (prepared-evict-first-under-256mb.diff: the policy only
# while a layer's K / V stay under 256 MB). Carry .whl, .triton-cache, .variants. Results as
# gpu_frames_ab.sh's (new = the patched tree).
#   bash scripts/gpu_prepared_s44.sh
#   DIFF=prepared-evict-first-under-256mb.diff bash scripts/gpu_prepared_s44.sh
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
EF=${EF:-/tmp/ef}
rm -rf "$EF" && mkdir -p "$EF" && cp -r "$ROOT/tts_server" "$ROOT/csrc" "$ROOT/scripts" "$ROOT/tests" "$ROOT/pyproject.toml" "$EF/"
ln -s "$ROOT/.whl" "$EF/.whl" && ln -s "$ROOT/.triton-cache" "$EF/.triton-cache"
rm -rf "$EF/csrc/build" "$EF"/csrc/*.so
(cd "$EF" && patch -p1 < "$ROOT/.variants/${DIFF:-prepared-evict-first.diff}") || { echo "patch failed"; exit 1; }
export OUT=${OUT:-$ROOT/out} TTS_ATTN_KERNEL=1
make -s -C "$ROOT/csrc" libqwen_small.so libqwen_attn.so > "$OUT/build-base.log" 2>&1 || tail -5 "$OUT/build-base.log"
make -s -C "$EF/csrc" libqwen_small.so libqwen_attn.so > "$OUT/build.log" 2>&1 || tail -5 "$OUT/build.log"
grep -h "attn_persist_v2" -A3 "$OUT/build.log" | grep -E "registers|spill" | head -2
BASE=$ROOT PRE_TESTS=${PRE_TESTS-tests/test_attn_kernel.py} TEST_TIMEOUT=300 DIGEST=0 ROUNDS=${ROUNDS:-2} \
  SIZES=${SIZES:-16,32,64,128,256} RUN_TIMEOUT=150 COMMIT=evict-first bash "$EF/scripts/gpu_frames_ab.sh" 2>&1 \
  | grep -E "==|mixed|differ|rc|engine: |passed|failed" | tail -40
(cd "$OUT" && tar -czf logs.tgz ./*.log ./env.txt 2>/dev/null; rm -f ./*.log ./env.txt)
