#!/usr/bin/env bash
# CPU only, on the device host: a burst of CALLS (256) calls over one gRPC connection, against a
# bare grpc.aio server (scripts/grpc_intake_bench.py) and against the real RPC side of two trees
# (scripts/onec_intake_trace.py: the paced engine in its engine process; the loop thread's CPU
# per part), ROUNDS (3) rounds alternating BASE (default .base: e.g. `git archive <rev>
# tts_server tts_client | tar -x -C .base`) and this tree. JSON lines in $OUT/onec.jsonl.
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=${PYTHONPATH:-}
BASE=${BASE:-.base}
CALLS=${CALLS:-256}
echo "cores: $(nproc)" | tee $OUT/onec.txt
for i in 1 2; do
  timeout 120 $PY scripts/grpc_intake_bench.py --calls $CALLS --procs 1 --shared-channel 2>/dev/null | tail -1 | tee -a $OUT/onec.jsonl
done
for r in $(seq ${ROUNDS:-3}); do
  for t in "$BASE" .; do
    timeout 200 $PY scripts/onec_intake_trace.py --calls $CALLS --tree "$t" --label "$t" 2>>$OUT/onec.err | tee -a $OUT/onec.jsonl
  done
done
