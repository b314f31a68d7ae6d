#!/usr/bin/env bash
# A/B of the server's GIL switch interval (TTS_GIL_SWITCH_MS) on one machine: gpu_server_bench.sh
# with c = 1 and the 256-stream start only, at each interval in SWITCH_MS (default "5 0.5": Python's
# default, then the server's). Results under $OUT/gil-<ms>/.
OUT=${OUT:-out}
for ms in ${SWITCH_MS:-5 0.5}; do
  echo "=== TTS_GIL_SWITCH_MS=$ms"
  OUT=$OUT/gil-$ms TTS_GIL_SWITCH_MS=$ms RPS= TEXT_BENCH= TRANSPORT=${TRANSPORT:-grpc} \
    SERVER_ARGS=${SERVER_ARGS:---http-port -1} bash "$(dirname "$0")/gpu_server_bench.sh"
done
