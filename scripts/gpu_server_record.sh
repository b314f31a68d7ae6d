#!/usr/bin/env bash
# One GPU call for a session's server record: the GPU prompt test, then scripts/gpu_server_bench.sh
# with the standard loads (c = 1; 256 x 6 s streams from 1 and 8 load processes; open loop 20 /
# 40 / 60 RPS; incremental text at 1 / 16 / 64 contexts), its many files packed into
# $OUT/server.tar.gz (the device tool returns at most 8 files).
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
timeout 120 $PY -m pytest -q -m gpu tests/test_prompt_many.py -p no:cacheprovider 2>&1 | tail -2
FINAL=$OUT
export OUT=$FINAL/s
mkdir -p "$OUT"
BENCH_PROCS=${BENCH_PROCS:-1,8} RPS=${RPS:-20,40,60} RPS_REQUESTS=${RPS_REQUESTS:-150} TEXT_BENCH=${TEXT_BENCH:-1,16,64} \
  TRANSPORT=grpc SERVER_ARGS=${SERVER_ARGS:---http-port -1} timeout ${BENCH_TOTAL_TIMEOUT:-460} bash scripts/gpu_server_bench.sh 2>&1 | tail -40
gzip -f "$OUT/steps.jsonl" "$OUT/server.log" 2>/dev/null
tar czf "$FINAL/server.tar.gz" -C "$FINAL" s && rm -rf "$OUT"
