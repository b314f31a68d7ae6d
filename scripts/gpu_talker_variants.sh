#!/usr/bin/env bash
# The small-batch kernel's talker layers: this tree's build against variants of it built with
# DEFS (VARIANTS: "name:-DFLAG ..." words, default the first-item K / V prefetch QTK_PREFETCH),
# ROUNDS alternating rounds of scripts/gpu_talker_layers.py (bitwise checks, timing, the hop
# trace) at POSITIONS. Carry .whl and .triton-cache. Results: $OUT/<name>-<round>.txt, the JSON
# in $OUT/variants.tar.gz.
#   bash scripts/gpu_talker_variants.sh
source "$(dirname "$0")/gpu_env.sh"
make -s -C csrc libqwen_small.so > "$OUT/build-base.log" 2>&1 || { tail -20 "$OUT/build-base.log"; exit 1; }
names="base"
for v in ${VARIANTS:-prefetch:-DQTK_PREFETCH}; do
  name=${v%%:*}
  make -s -C csrc SMALL_LIB="build/$name.so" DEFS="${v#*:}" "build/$name.so" > "$OUT/build-$name.log" 2>&1 \
    || { tail -20 "$OUT/build-$name.log"; continue; }
  grep -E "registers|spill" "$OUT/build-$name.log" | head -4
  names="$names $name"
done
for r in $(seq "${ROUNDS:-2}"); do
  for name in $names; do
    lib=$([ "$name" = base ] && echo csrc/libqwen_small.so || echo "csrc/build/$name.so")
    QSK_LIB="$ROOT/$lib" PYTHONPATH=. timeout 200 python3 scripts/gpu_talker_layers.py --out "$OUT/$name-$r" \
      --positions ${POSITIONS:-1 64 500 2047} > "$OUT/$name-$r.txt" 2>&1
    echo "== $name round $r (rc $?)"
    grep -E "^pos|ALL|DIFF|graph|epoch" "$OUT/$name-$r.txt" | sed 's/hidden_equal.*first_diff/.. first_diff/'
  done
done
(cd "$OUT" && tar czf variants.tar.gz ./*-[0-9]/ && rm -rf ./*-[0-9]/)
