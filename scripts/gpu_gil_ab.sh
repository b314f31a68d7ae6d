#!/usr/bin/env bash
# A/B of the server's GIL switch interval (env TTS_GIL_SWITCH_MS; unset: Python's 5 ms) on one
# machine: gpu_server_bench.sh with c = 1 and the 256-stream start only, at each interval in
# SWITCH_MS (default "5 0.5"). Results under $OUT/gil-<ms>/. On the H100 (2026-11-25) 0.5 ms was
# worse: 256-stream TTFC p95 595 vs 394 ms and 57% underruns, so the server keeps the default.
OUT=${OUT:-out}
for ms in ${SWITCH_MS:-5 0.5}; do
  echo "=== TTS_GIL_SWITCH_MS=$ms"
  OUT=$OUT/gil-$ms TTS_GIL_SWITCH_MS=$ms RPS= TEXT_BENCH= TRANSPORT=${TRANSPORT:-grpc} \
    SERVER_ARGS=${SERVER_ARGS:---http-port -1} bash "$(dirname "$0")/gpu_server_bench.sh"
done
