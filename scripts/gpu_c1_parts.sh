#!/usr/bin/env bash
# The GPU parts of one stream's first audio, A/B in one call: the codec step vs B (bench_codec.py
# speed; this tree also its GPU tests and bitwise invariance) against BASE's (a directory with
# another tree's tts_server/, tests/ and scripts/), then this tree's admission + first frame
# under each TTS_PDL_PREFILL_ROWS in PREFILL_ROWS (gpu_first_audio_parts.py; equal digests =
# the same bits). The base codec last (CODEC_BASE=0 skips it). Results under $OUT; tables on stdout.
source "$(dirname "$0")/gpu_env.sh"
BASE=${BASE:-.base}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
echo "base $BASE, new ${COMMIT:-?}" | tee -a "$OUT/env.txt"
timeout 330 $PY scripts/bench_codec.py --stages "${CODEC_STAGES:-pytest,invariance,speed}" --out "$OUT/codec-new" \
  > "$OUT/codec-new.log" 2>&1
echo "codec new rc=$?"; grep -E "pytest gpu rc|invariant|^.*bf16 \{'B'|step_api_ms_B1|Error|error" "$OUT/codec-new.log" | cut -c1-220 | head -30
for rows in ${PREFILL_ROWS:-0 64}; do
  TTS_PDL_PREFILL_ROWS=$rows timeout 150 $PY scripts/gpu_first_audio_parts.py --out "$OUT/parts-$rows" \
    > "$OUT/parts-$rows.log" 2>&1
  echo "== prefill PDL rows <= $rows: $(grep -E 'first frame, prompt|digest' "$OUT/parts-$rows.log" | cut -c1-400)"
done
[ "${CODEC_BASE:-1}" = 1 ] || exit 0
(cd "$BASE" && timeout 200 $PY scripts/bench_codec.py --stages speed --out "$OUT/codec-base") > "$OUT/codec-base.log" 2>&1
echo "codec base rc=$?"; grep -E "bf16 \{'B'|step_api_ms_B1" "$OUT/codec-base.log" | cut -c1-220 | head -12
