#!/usr/bin/env bash
# Same-host A/B of two server trees (each H100 call may land on a different host, and host speed
# moves the server's numbers a lot): BASE (a directory with another tree's tts_server/ and
# tts_client/, e.g. `git archive <rev> tts_server tts_client | tar -x -C .base`) and this tree,
# both started at once on the full-size synthetic model (--max-streams 256 each: two fit on an
# 80 GB H100), then benchmarked one at a time, interleaved: c = 1 (30 requests; ROUNDS times,
# default 1, alternating the trees, for changes smaller than one run's spread), then STREAMS
# (256) concurrent 6 s streams from each BENCH_PROCS (1,8) load processes (STREAMS=0: none),
# BURST_ROUNDS times (default 1), alternating the trees; then RPS (e.g. "20,60": open-loop Poisson
# arrivals, 200 requests each, RPS_ROUNDS times, default 1; none by default).
# Results: $OUT/ab.tar.gz (per tree: c1-*.json, cN-*-pK.json, steps-*.jsonl, server-*.log) and
# the tables on stdout. COMPARE=1: first, the same requests to both servers, their audio compared
# byte for byte (scripts/compare_servers.py), for changes that must keep the bytes.
# TRANSPORT=http: every bench through the OpenAI-compatible HTTP API (the servers listen on
# port + 100). CONNECTIONS=N: the bursts' gRPC clients share N connections (tts-bench
# --connections; default: a connection per stream). ONE_CONNECTION_BURSTS=N: N more gRPC bursts
# per tree with every call on one connection.
source "$(dirname "$0")/gpu_env.sh"
BASE=${BASE:-.base}
STREAMS=${STREAMS:-256}
BENCH_PROCS=${BENCH_PROCS:-1,8}
R=$OUT/ab
rm -rf "$R"  # a results folder of an earlier run (seen once on the device) must not mix in
mkdir -p "$R"
if [ -n "${PRE_TESTS:-}" ]; then  # GPU tests of the new tree first (e.g. PRE_TESTS="tests/test_hostcopy.py ...")
  PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} timeout 300 $PY -m pytest -q -m gpu $PRE_TESTS -p no:cacheprovider 2>&1 \
    | grep -E "passed|failed|error|FAILED|Error" | tail -8
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$R/env.txt"
echo "base $BASE, new ${COMMIT:-?}" | tee -a "$R/env.txt"

TRANSPORT=${TRANSPORT:-grpc}
http_of() { [ "$TRANSPORT" = http ] && echo $(($1 + 100)) || echo -1; }
start() {  # tree name port [extra server flags] [extra environment, NAME=VALUE ...]
  (cd "$1" && export TTS_STEP_TRACE="$R/steps-$2.jsonl" PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" $5 \
     && exec $PY -m tts_server --port "$3" --http-port "$(http_of "$3")" --metrics-port -1 --model synthetic \
       --max-streams 256 $4 \
     >"$R/server-$2.log" 2>&1) &
}
# BASE_ARGS / NEW_ARGS: extra flags per tree (e.g. BASE=. BASE_ARGS="--rpc-listeners 1": one tree, two settings);
# BASE_ENV / NEW_ENV: extra environment per tree (e.g. NEW_ENV="TTS_GEMM_DTYPE=fp16")
# One after the other: on a fresh machine the second server then finds most of its kernels in
# the Triton cache the first one filled (two cold servers compiling at once took 286 s to serve)
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
start "$BASE" base 50081 "${BASE_ARGS:-}" "${BASE_ENV:-}"
PID_BASE=$!
PIDS="$PID_BASE"
trap 'kill -TERM $PIDS 2>/dev/null; wait 2>/dev/null' EXIT
$PY scripts/wait_serving.py 50081 $PID_BASE 420 || { echo "server 50081 did not start"; tail -20 "$R"/server-base.log; exit 1; }
echo "base SERVING after $SECONDS s"
start . new 50082 "${NEW_ARGS:-}" "${NEW_ENV:-}"
PID_NEW=$!
PIDS="$PID_BASE $PID_NEW"
$PY scripts/wait_serving.py 50082 $PID_NEW 420 || { echo "server 50082 did not start"; tail -20 "$R"/server-new.log; exit 1; }
echo "both SERVING after $SECONDS s"
[ "${SAVE_CACHE:-0}" = 1 ] && save_triton_cache  # $OUT/triton-cache.tgz, for the next call (gpu_env.sh)
if [ "${COMPARE:-0}" = 1 ]; then  # the same requests to both, all at once: equal bytes?
  echo "== same bytes? $(timeout 300 $PY scripts/compare_servers.py 127.0.0.1:50081 127.0.0.1:50082)"
fi
port_of() { [ "$1" = base ] && echo 50081 || echo 50082; }
bench() {  # --address 127.0.0.1:PORT first
  local port=${2##*:}
  timeout 120 $PY -m tts_client.bench --transport "$TRANSPORT" --http-url "http://127.0.0.1:$((port + 100))" \
    --no-progress "$@" 2>&1 | grep -E "^(grpc|http|first audio)"; }
for round in $(seq 1 "${ROUNDS:-1}"); do
  for tree in base new; do
    port=$(port_of $tree)
    name=$tree$([ "${ROUNDS:-1}" = 1 ] || echo "-r$round")
    echo "== $name c=1"
    bench --address 127.0.0.1:$port --concurrency 1 --requests 30 --warmup 3 --workload english --max-duration 2 \
      --json "$R/c1-$name.json"
  done
done
[ "$STREAMS" = 0 ] && BENCH_PROCS=""
for round in $(seq 1 "${BURST_ROUNDS:-1}"); do
  for procs in ${BENCH_PROCS//,/ }; do
    for tree in base new; do
      port=$(port_of $tree)
      name=$tree-p$procs$([ "${BURST_ROUNDS:-1}" = 1 ] || echo "-r$round")
      echo "== $name c=$STREAMS, $procs load processes"
      bench --address 127.0.0.1:$port --concurrency "$STREAMS" --requests "$STREAMS" --warmup 0 --workload english \
        --max-duration 6 --fixed-duration --processes "$procs" --connections "${CONNECTIONS:-0}" --json "$R/cN-$name.json"
    done
  done
done
RPS=${RPS:-}
for round in $(seq 1 "${RPS_ROUNDS:-1}"); do
  for rate in ${RPS//,/ }; do
    for tree in base new; do
      port=$(port_of $tree)
      name=$tree-rps$rate$([ "${RPS_ROUNDS:-1}" = 1 ] || echo "-r$round")
      echo "== $name"
      bench --address 127.0.0.1:$port --concurrency "" --rps "$rate" --requests 200 --warmup 0 --workload english \
        --max-duration 20 --json "$R/rps-$name.json"
    done
  done
done
for round in $(seq 1 "${ONE_CONNECTION_BURSTS:-0}"); do  # gRPC bursts with every call on one connection
  for tree in base new; do
    port=$(port_of $tree)
    name=$tree-conn1-r$round
    echo "== $name c=$STREAMS over one gRPC connection"
    TRANSPORT=grpc bench --address 127.0.0.1:$port --concurrency "$STREAMS" --requests "$STREAMS" --warmup 0 \
      --workload english --max-duration 6 --fixed-duration --connections 1 --json "$R/cN-$name.json"
  done
done
kill -TERM $PIDS 2>/dev/null; wait 2>/dev/null
tar -czf "$OUT/ab.tar.gz" -C "$OUT" ab && rm -rf "$R"
