#!/usr/bin/env bash
# The server's capacity on a CUDA machine (issue #18's acceptance), in one call: tts-server on the
# full-size synthetic model with its default flags (engine auto = batched, --max-streams = what
# fits up to 256), then tts-bench against it over loopback gRPC:
#   1. c = 1: TTFC p50 (target <= 10 ms) and the server's first-audio breakdown;
#   2. closed loop, STREAMS (default 256) concurrent streams of DURATION (6) s each: underruns at a
#      200 ms pre-roll (target: none) and TTFC p95 (target <= 150 ms) (STREAMS=0: skipped); BENCH_PROCS (default 1):
#      load processes for that level (tts-bench --processes), so that the client's own event loop
#      does not spread the sends and delay the reads; a list (1,8) runs the level once per value
#      (cN.json for the first, cN-procsK.json for the others); BURST_ROUNDS (default 1) repeats
#      them (cN-rR.json, cN-procsK-rR.json for rounds R >= 2);
#   3. open loop, Poisson arrivals at RPS (default 10,20,40) requests/s, English prompts of 5-40
#      words: TTFA p95 (target <= 40 ms at 20) and the highest rate with zero underruns;
#      RPS_REQUESTS (default 200) requests per level, or a list, one count per level (rps-R.json each).
#   4. (TEXT_BENCH, default 1,16,64; empty: skip) incremental text: that many StreamSynthesize calls
#      fed a word at a time (tts_client.text_bench).
# Results: $OUT/{server.log, c1.json, cN.json, rps.json, text.json, steps.jsonl (one line per engine
# step, TTS_STEP_TRACE), bench.log, env.txt}; tables print last.
# Wheels the GPU image lacks are carried in .whl/ (scripts/fetch_gpu_wheels.sh).
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
STREAMS=${STREAMS:-256}
BENCH_PROCS=${BENCH_PROCS:-1}
DURATION=${DURATION:-6}
RPS=${RPS-10,20,40}  # empty: no open-loop phase
PORT=${PORT:-50077}
SERVER_ARGS=${SERVER_ARGS:-}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/env.txt"
$PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/env.txt"
echo "tree: ${COMMIT:-unknown (pass COMMIT=<hash> from your checkout: the git metadata on the device may be stale)}" | tee -a "$OUT/env.txt"

t0=$(date +%s)
HTTP_PORT=${HTTP_PORT:-8077}
TRANSPORT=${TRANSPORT:-both}  # grpc | http | both (the OpenAI-compatible API beside gRPC, same run)
TTS_STEP_TRACE="$OUT/steps.jsonl" $PY -m tts_server --port "$PORT" --http-port "$HTTP_PORT" --model synthetic --metrics-port -1 $SERVER_ARGS >"$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
$PY scripts/wait_serving.py "$PORT" "$SERVER" 420 || { echo "server did not start"; tail -30 "$OUT/server.log"; exit 1; }
echo "server SERVING after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/env.txt"
grep -E "memory plan|batched engine|codec" "$OUT/server.log" | tee -a "$OUT/env.txt"

bench() { timeout "${BENCH_TIMEOUT:-200}" $PY -m tts_client.bench --address "127.0.0.1:$PORT" \
  --http-url "http://127.0.0.1:$HTTP_PORT" --transport "$TRANSPORT" --no-progress "$@"; }
phase() { echo "== $* == $(date +%s.%N)"; }  # the unix time lines the phases up with steps.jsonl
{
  phase c=1
  bench --concurrency 1 --requests 30 --warmup 3 --workload english --max-duration 2 --json "$OUT/c1.json"
  first=1
  [ "$STREAMS" = 0 ] && BENCH_PROCS=  # STREAMS=0: no closed-loop level
  for round in $(seq 1 "${BURST_ROUNDS:-1}"); do  # a burst's p95 moves by tens of ms between runs
    for procs in ${BENCH_PROCS//,/ }; do  # BENCH_PROCS=1,8: the same level from 1 then 8 load processes
      phase "c=$STREAMS x ${DURATION}s, $procs load processes, round $round"
      [ $first = 1 ] && json=cN.json || json=cN-procs$procs.json
      [ "$round" = 1 ] || json=${json%.json}-r$round.json
      bench --concurrency "$STREAMS" --requests "$STREAMS" --warmup 0 --workload english \
        --max-duration "$DURATION" --fixed-duration --processes "$procs" --json "$OUT/$json"
      first=0
    done
    first=1
  done
  if [ -n "$RPS" ] && [[ "${RPS_REQUESTS:-200}" == *,* ]]; then  # a request count per level: one run each
    IFS=, read -ra rates <<< "$RPS"; IFS=, read -ra counts <<< "$RPS_REQUESTS"
    for i in "${!rates[@]}"; do
      phase "open loop ${rates[$i]} rps, ${counts[$i]} requests"
      bench --concurrency "" --rps "${rates[$i]}" --requests "${counts[$i]}" --warmup 0 --workload english \
        --max-duration 20 --json "$OUT/rps-${rates[$i]}.json"
    done
  elif [ -n "$RPS" ]; then
    phase "open loop $RPS rps"
    bench --concurrency "" --rps "$RPS" --requests "${RPS_REQUESTS:-200}" --warmup 0 --workload english \
      --max-duration 20 --json "$OUT/rps.json"
  fi
  if [ -n "${TEXT_BENCH-1,16,64}" ]; then  # StreamSynthesize fed a word at a time (issue 20)
    phase "incremental text ${TEXT_BENCH-1,16,64}"
    timeout 300 $PY -m tts_client.text_bench --address "127.0.0.1:$PORT" --concurrency "${TEXT_BENCH-1,16,64}" \
      --json "$OUT/text.json"
  fi
  phase end
} 2>&1 | tee "$OUT/bench.log" | grep -E "^(==|system|----|grpc|http|first audio|summary|error|streams|text|  )"
tail -5 "$OUT/server.log"
