#!/usr/bin/env bash
# Same-call A/B of the persistent decode attention split (csrc/attn/decode_split.cuh) against
# BASE's (a directory holding another tree's tts_server/, csrc/ and scripts/, e.g. `git archive
# <rev> tts_server csrc scripts | tar -x -C .base`): ROUNDS alternating rounds of
# gpu_attn_persist.py --quick in each tree (v2 at 2 stages checked bitwise against the Triton split,
# then timed beside it and the walk alone, µs a layer at B = 16 / 64 / 256 mixed and 256 at 1,000),
# then, with FRAMES=1, gpu_frames_ab.sh at SIZES (each tree's libqwen_attn.so serving its engine).
# VARIANTS: more trees (directories like BASE) timed in the same rounds after base and new.
# Results: $OUT/persist-{base,new,<variant>}-<round>.log, attn_persist.json packed in
# $OUT/persist.tgz, and gpu_frames_ab.sh's.
#   BASE=.base ROUNDS=2 FRAMES=1 SIZES=16,64,256 bash scripts/gpu_attn_ab.sh
#   FRAMES=0 VARIANTS=".variants/a .variants/b" bash scripts/gpu_attn_ab.sh
source "$(dirname "$0")/gpu_env.sh"
BASE=${BASE:-.base}
export TTS_ATTN_KERNEL=1
if [ "${FRAMES:-1}" = 1 ]; then
  make -s -C csrc libqwen_small.so libqwen_attn.so > "$OUT/build.log" 2>&1 || tail -5 "$OUT/build.log"
  make -s -C "$BASE/csrc" libqwen_small.so libqwen_attn.so > "$OUT/build-base.log" 2>&1 || tail -5 "$OUT/build-base.log"
fi
for r in $(seq "${ROUNDS:-2}"); do
  for tree in base new ${VARIANTS:-}; do
    dir=$(case $tree in base) echo "$BASE" ;; new) echo . ;; *) echo "$tree" ;; esac)
    tree=$(basename "$tree")
    (cd "$dir" && PYTHONPATH=. timeout "${PERSIST_TIMEOUT:-150}" $PY scripts/gpu_attn_persist.py --quick \
      --out "$OUT/persist/$tree-$r") > "$OUT/persist-$tree-$r.log" 2>&1
    echo "== persist $tree round $r (rc $?)"
    grep -E "differ|B[0-9]+\|" "$OUT/persist-$tree-$r.log" | grep -vE ": m 0 of [0-9]+ differ, 0 unused written, l 0" \
      | sed -E 's/"(GBps)": [0-9.]+//g' | cut -c1-300
  done
done
(cd "$OUT" && find persist -name '*.so' -delete && tar -czf persist.tgz persist && rm -rf persist)
if [ "${FRAMES:-1}" = 1 ]; then
  DIGEST=0 ROUNDS=${FRAME_ROUNDS:-1} SIZES=${SIZES:-16,64,256} RUN_TIMEOUT=150 COMMIT=attn-ab bash scripts/gpu_frames_ab.sh \
    2>&1 | grep -E "==|mixed|differ|rc|engine: " | tail -30
fi
(cd "$OUT" && tar -czf logs.tgz ./*.log ./env.txt 2>/dev/null; rm -f ./*.log ./env.txt)
