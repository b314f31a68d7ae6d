#!/usr/bin/env bash
# Who holds the GIL while the server takes a 256-stream burst: the server runs under py-spy
# (sampling only the thread that holds the GIL, per thread, raw collapsed stacks), takes BURSTS
# bursts of 256 concurrent 6 s streams (1 load process), and stops; scripts/spy_summary.py then
# splits the serving samples by thread and by the server's own functions. Needs the py-spy wheel
# in .whl/ (scripts/fetch_gpu_wheels.sh). Results: $OUT/burst.tar.gz.
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
R=$OUT/b; mkdir -p "$R"
SPY=/tmp/site/bin/py-spy
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$R/env.txt"
PORT=50091
TTS_STEP_TRACE="$R/steps.jsonl" $SPY record --rate ${RATE:-200} --threads --gil --nonblocking --format raw \
  -o "$R/spy.txt" -- $PY -m tts_server --port $PORT --http-port -1 --metrics-port -1 --model synthetic \
  >"$R/server.log" 2>&1 &
SPY_PID=$!
sleep 2
SERVER=$(pgrep -f "tts_server --port $PORT" | head -1)
$PY scripts/wait_serving.py $PORT "$SERVER" 420 || { echo "server did not start"; tail -20 "$R/server.log"; exit 1; }
echo "SERVING after $SECONDS s" | tee -a "$R/env.txt"
date +%s.%N > "$R/serving_at"
for i in $(seq ${BURSTS:-2}); do
  timeout 120 $PY -m tts_client.bench --transport grpc --no-progress --address 127.0.0.1:$PORT --concurrency 256 \
    --requests 256 --warmup 0 --workload english --max-duration 6 --fixed-duration --json "$R/cN-$i.json" 2>&1 \
    | grep -E "^(grpc|first audio)"
done
kill -INT "$SERVER"; wait $SPY_PID
$PY scripts/spy_summary.py "$R/spy.txt" | tee "$R/summary.txt" | head -70
gzip -f "$R/spy.txt" "$R/steps.jsonl" "$R/server.log"
tar czf "$OUT/burst.tar.gz" -C "$R" .
