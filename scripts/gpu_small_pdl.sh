#!/usr/bin/env bash
# The small-batch kernel (code predictor and talker variants) as a programmatic dependent of the
# kernel before it, and on fewer blocks: the GPU tests TESTS (default test_small_kernel.py; "": none),
# then ROUNDS rounds of gpu_pdl_ab.py over VARIANTS (alternating order) at SIZES. Carry .whl and
# .triton-cache.
#   bash scripts/gpu_small_pdl.sh
source "$(dirname "$0")/gpu_env.sh"
make -s -C csrc libqwen_small.so libqwen_attn.so > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
grep -E "registers|spill" "$OUT/build.log" | head -4
if [ "${TESTS-x}" != "" ]; then
  PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} timeout ${TEST_TIMEOUT:-300} $PY -m pytest -q -m gpu ${TESTS:-tests/test_small_kernel.py} \
    -p no:cacheprovider > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; tail -2 "$OUT/tests.log"
fi
variants=${VARIANTS:-small_nopdl,default,small_b132}
for r in $(seq "${ROUNDS:-2}"); do
  [ $((r % 2)) = 0 ] && v=$(echo "$variants" | tr , '\n' | tac | paste -sd,) || v=$variants
  PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} timeout 250 $PY scripts/gpu_pdl_ab.py --out "$OUT/r$r" \
    --sizes "${SIZES:-1,16}" --variants "$v" > "$OUT/r$r.log" 2>&1
  echo "== round $r (rc $?): $v"
  grep -E "== |mixed|bitwise|Error|error" "$OUT/r$r.log" | grep -v "^$" | cut -c1-200
done
(cd "$OUT" && tar czf rounds.tar.gz r[0-9]*/ && rm -rf r[0-9]*/)
