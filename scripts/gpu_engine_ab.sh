#!/usr/bin/env bash
# Same-call A/B of two batched-engine trees on one GPU: BASE (a directory holding another tree's
# tts_server/ and scripts/, e.g. `git archive <rev> tts_server scripts | tar -x -C .base`) and this
# tree. Per tree: the GPU digest of 8 admissions x 48 frames (scripts/interp_engine_digest.py
# --device cuda; equal digests = the same codes and hidden states, bit for bit; DIGEST=0 skips it)
# and the graph-replay frame times (gpu_batched_engine.py --sections bench). PRE_TESTS: GPU tests
# of this tree first. ATTN=1: also the decode attention alone, each tree's own configuration
# (gpu_frame_profile.py --sections attention, ATTN_SWEEP=default).
# Results: $OUT/{base,new}/*.json, $OUT/digest-{base,new}.txt, tables on stdout.
source "$(dirname "$0")/gpu_env.sh"
BASE=${BASE:-.base}
ab_start
if [ "${ATTN:-0}" = 1 ]; then
  for tree in base new; do
    dir=$([ $tree = base ] && echo "$BASE" || echo .)
    ATTN_SWEEP=default timeout 200 $PY "$dir/scripts/gpu_frame_profile.py" --sections attention --out "$OUT/$tree" \
      > "$OUT/attention-$tree.log" 2>&1
    echo "== $tree attention"; grep -E "B[0-9]+\||accuracy" "$OUT/attention-$tree.log"
  done
fi
ab_digests
for tree in base new; do
  dir=$([ $tree = base ] && echo "$BASE" || echo .)
  timeout 200 $PY "$dir/scripts/gpu_batched_engine.py" --sections bench --out "$OUT/$tree" > "$OUT/bench-$tree.log" 2>&1
  echo "== $tree"; grep -E "ctx +mixed|ctx +100 B +1:" "$OUT/bench-$tree.log"
done
