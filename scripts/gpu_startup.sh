#!/usr/bin/env bash
# How long a GPU server takes to start at its default flags (full-size synthetic model): first on a
# machine whose Triton cache is empty (TRITON_CACHE_DIR a new folder: every kernel compiles), then
# again with the cache that start filled. Each start is timed to SERVING on grpc.health.v1
# (scripts/wait_serving.py) and then serves 5 requests at c = 1 with no warm-up (the server log
# has each one's first audio: does the first request after start pay for anything?). Results:
# $OUT/{env.txt, server-<run>.log, c1-<run>.json} per start (RUNS, default "cold warm"; CACHE=carried
# starts from the carried Triton cache instead of an empty one; a run labelled nowarm... starts
# without the warm-up request, serving/warm_up.py).
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
$PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/env.txt"
echo "tree: ${COMMIT:-unknown}" | tee -a "$OUT/env.txt"
if [ "${CACHE:-fresh}" = fresh ]; then  # CACHE=carried: gpu_env.sh's (a carried .triton-cache) instead
  export TRITON_CACHE_DIR=/tmp/triton-startup-$$
  rm -rf "$TRITON_CACHE_DIR"
fi
PORT=${PORT:-50077}
for run in ${RUNS:-cold warm}; do  # the labels of the starts, one after another on the same cache
  t0=$(date +%s.%N)
  off=""; [ "${run#nowarm}" != "$run" ] && off="TTS_WARM_UP_REQUEST=0"  # a run labelled nowarm*: without it
  env $off $PY -m tts_server --port "$PORT" --http-port -1 --model "${MODEL:-synthetic}" --metrics-port -1 ${SERVER_ARGS:-} \
    > "$OUT/server-$run.log" 2>&1 &
  server=$!
  if $PY scripts/wait_serving.py "$PORT" "$server" "${START_TIMEOUT:-420}"; then
    echo "$run: SERVING after $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}") s, $(ls "$TRITON_CACHE_DIR" 2>/dev/null | wc -l) cache entries" \
      | tee -a "$OUT/env.txt"
    grep -E "start-up took|batched engine:|codec:|warm-up request" "$OUT/server-$run.log" | cut -c1-220 | tee -a "$OUT/env.txt"
    timeout 120 $PY -m tts_client.bench --address "127.0.0.1:$PORT" --transport grpc --no-progress --concurrency 1 \
      --requests 5 --warmup 0 --workload english --max-duration 2 --json "$OUT/c1-$run.json" | grep -E "^grpc"
    grep -oE "request [^ ]+ done: .*ttfc [0-9.]+ ms" "$OUT/server-$run.log" | sed -E 's/done: .*(ttfc)/\1/'
  else
    echo "$run: not SERVING"; tail -20 "$OUT/server-$run.log"
  fi
  kill -TERM "$server" 2>/dev/null; wait "$server" 2>/dev/null
done
