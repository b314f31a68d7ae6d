#!/usr/bin/env bash
# Same-call A/B of two trees' batched frames on one GPU: BASE (a directory holding another tree's
# tts_server/ beside a copy of THIS tree's scripts/, e.g. `git archive <rev> tts_server | tar -x -C
# .base && cp -r scripts .base/`) and this tree. ROUNDS alternating rounds of gpu_pdl_ab.py's
# default variant per tree (VARIANTS: a list of its variants instead, default first; a fresh
# engine: graph-replay frame at B = SIZES, mixed contexts; one stream's admission + first frame;
# the codes and hidden states of 64 and of 4 admissions over 16 sampled frames, saved as
# sigs.npz), then those signatures compared across the trees (equal: the same bits), and each
# tree's engine digest (DIGEST=0: not). PRE_TESTS: GPU tests of this tree first. Results:
# $OUT/{base,new}-<round>.log and, packed in $OUT/rounds.tar.gz, {base,new}-<round>/.
source "$(dirname "$0")/gpu_env.sh"
BASE=${BASE:-.base}
SIZES=${SIZES:-1,16,64,128,256}
ROUNDS=${ROUNDS:-2}
ab_start
ab_digests
for r in $(seq "$ROUNDS"); do
  for tree in base new; do
    dir=$([ $tree = base ] && echo "$BASE" || echo .)
    timeout "${RUN_TIMEOUT:-280}" $PY "$dir/scripts/gpu_pdl_ab.py" --variants "${VARIANTS:-default}" --sizes "$SIZES" \
      --out "$OUT/$tree-$r" > "$OUT/$tree-$r.log" 2>&1
    echo "== $tree round $r (rc $?)"; grep -E "\] == |B +[0-9]+ mixed|admission of|engine: " "$OUT/$tree-$r.log"
  done
done
$PY - "$OUT" "$ROUNDS" <<'PYEOF'
import sys
import numpy as np
out, rounds = sys.argv[1], int(sys.argv[2])
try:
    ref = np.load(f"{out}/base-1/sigs.npz")
    for r in range(1, rounds + 1):
        for tree in ("base", "new"):
            s = np.load(f"{out}/{tree}-{r}/sigs.npz")
            print(f"{tree}-{r} vs base-1: entries that differ",
                  {k: f"{int((s[k] != ref[k]).sum())} of {s[k].size}" for k in ref.files})
except Exception as e:  # a tree that failed has no signatures
    print("signatures:", repr(e))
PYEOF
# the rounds' folders (JSON and signatures) in one archive: the device tool returns a few files only
dirs=$(cd "$OUT" && find . -maxdepth 1 -type d \( -name 'base-*' -o -name 'new-*' \) -printf '%f\n' | sort)
if [ -n "$dirs" ]; then
  (cd "$OUT" && tar czf rounds.tar.gz $dirs && rm -rf $dirs) && echo "rounds: $OUT/rounds.tar.gz"
fi
