#!/usr/bin/env bash
# The codec's K pieces (split-K at small B) against BASE's tree in one call: this tree's GPU tests,
# bitwise invariance (bf16 and fp32) and step time vs B; then its step time with the pieces as
# whole taps (TTS_CODEC_PIECE_COLS large) and with CODEC_VARIANTS' tiles; then BASE's invariance
# and step time (BASE: a directory with another tree's tts_server/, tests/ and scripts/).
# Results under $OUT; the lines that matter on stdout.
source "$(dirname "$0")/gpu_env.sh"
BASE=${BASE:-.base}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
echo "base $BASE, new ${COMMIT:-?}" | tee -a "$OUT/env.txt"
show() { grep -E "pytest gpu rc|invariance triton|^.*bf16[a-z0-9_]* \{'B': (1|8|64|256),|step_api_ms_B1|Error|error" "$1" | cut -c1-200 | head -40; }
timeout ${T_NEW:-300} $PY scripts/bench_codec.py --stages "${NEW_STAGES:-pytest,invariance,speed}" --out "$OUT/codec-new" \
  > "$OUT/codec-new.log" 2>&1
echo "== codec new rc=$?"; show "$OUT/codec-new.log"
if [ -n "${PIECES_ALT:-}" ]; then
  TTS_CODEC_PIECE_COLS=$PIECES_ALT timeout 150 $PY scripts/bench_codec.py --stages speed --out "$OUT/codec-alt" \
    > "$OUT/codec-alt.log" 2>&1
  echo "== codec pieces of <= $PIECES_ALT columns rc=$?"; show "$OUT/codec-alt.log"
fi
if [ -n "${CODEC_VARIANTS:-}" ]; then
  timeout 200 $PY scripts/bench_codec.py --stages variants --out "$OUT/codec-variants" > "$OUT/codec-variants.log" 2>&1
  echo "== codec variants rc=$?"; show "$OUT/codec-variants.log"
fi
[ "${CODEC_BASE:-1}" = 1 ] || exit 0
(cd "$BASE" && timeout ${T_BASE:-200} $PY scripts/bench_codec.py --stages "${BASE_STAGES:-invariance,speed}" \
  --out "$OUT/codec-base") > "$OUT/codec-base.log" 2>&1
echo "== codec base rc=$?"; show "$OUT/codec-base.log"
