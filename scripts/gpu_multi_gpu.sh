#!/usr/bin/env bash
# Issue #21's GPU evidence: capacity at 1 and 2 GPUs in ONE server (--devices), same tree, same
# machine (nvidia-h200-x2), plus one engine's fault on a real GPU ending only its own streams.
# Capacity = the most concurrent 6 s streams with every request OK and zero underruns at a
# 200 ms player pre-roll (tts-bench's closed loop, as scripts/gpu_server_bench.sh); near-linear
# (2 GPUs ~ 2x) is the goal.
#
# One phase per call (each fits the device tool's 10-minute limit):
#   PHASE=1gpu   tts-server --devices 0    ; tts-bench at LEVELS_1 (default 128,192,256)
#   PHASE=2gpu   tts-server --devices 0,1  ; tts-bench at LEVELS_2 (default 256,384,512)
#   PHASE=fault  tts-server --devices 0,1 --inject-fault device_error:kill-gpu@5: 16 streams, then
#                one request that faults its engine; expects UNAVAILABLE for exactly that engine's
#                streams, the others complete, health still SERVING, tts_engine_healthy 0 for one
#                device only, and new requests served by the other GPU.
# Results in $OUT/<phase>/: server.log, c*.json, bench.log, env.txt, fault.json.
# Example (the device tool, nvidia-h200-x2):
#   PHASE=1gpu OUT=$OUT bash scripts/gpu_multi_gpu.sh; then PHASE=2gpu ...; then PHASE=fault ...
# Per GPU the server takes what fits up to 256 streams (the memory plan); MAX_STREAMS_PER_GPU
# raises that (e.g. 384 on an H200) to look for the limit above the default.
# Time: one GPU's start-up took 68-196 s on the H100 (Triton compiles, graph capture); engines
# are built one GPU after the other, so 2gpu starts slower. If a phase nears the 10-minute limit,
# split LEVELS over calls. tts-bench is one Python process: at 512 streams it may be the limit
# itself (watch its CPU, e.g. `top -b -n1` beside it); underruns then understate the server.
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
PHASE=${PHASE:?PHASE=1gpu, 2gpu or fault}
DURATION=${DURATION:-6}
PORT=${PORT:-50079}
METRICS=${METRICS:-9479}
OUTP=$OUT/$PHASE
mkdir -p "$OUTP"

case $PHASE in
  1gpu)  DEVICES=0;   LEVELS=${LEVELS_1:-128,192,256}; EXTRA= ;;
  2gpu)  DEVICES=0,1; LEVELS=${LEVELS_2:-256,384,512}; EXTRA= ;;
  fault) DEVICES=0,1; LEVELS=; EXTRA="--inject-fault device_error:kill-gpu@5" ;;
  *) echo "PHASE must be 1gpu, 2gpu or fault"; exit 2 ;;
esac
EXTRA="$EXTRA ${SERVER_ARGS:-}"  # more server flags, e.g. SERVER_ARGS="--rpc-processes 4"
if [ -n "${MAX_STREAMS_PER_GPU:-}" ]; then
  EXTRA="$EXTRA --max-streams $MAX_STREAMS_PER_GPU"  # per engine: each engine plans its own
fi

nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$OUTP/env.txt"
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] || [ "$PHASE" = 1gpu ] || { echo "needs 2 GPUs"; exit 1; }
echo "tree: ${COMMIT:-unknown (pass COMMIT=$(git rev-parse --short HEAD))}" | tee -a "$OUTP/env.txt"

t0=$(date +%s)
$PY -m tts_server --port "$PORT" --metrics-port "$METRICS" --model synthetic --devices "$DEVICES" \
  --max-queue 0 --http-port -1 $EXTRA >"$OUTP/server.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
$PY scripts/wait_serving.py "$PORT" "$SERVER" 480 || { echo "server did not start"; tail -30 "$OUTP/server.log"; exit 1; }
echo "server SERVING after $(( $(date +%s) - t0 )) s" | tee -a "$OUTP/env.txt"
grep -E "memory plan|batched engine|engines:|codec" "$OUTP/server.log" | tee -a "$OUTP/env.txt"

if [ "$PHASE" != fault ]; then
  bench() { timeout "${BENCH_TIMEOUT:-420}" $PY -m tts_client.bench --address "127.0.0.1:$PORT" --no-progress "$@"; }
  {
    echo "== c=1 =="
    bench --concurrency 1 --requests 20 --warmup 3 --workload english --max-duration 2 --json "$OUTP/c1.json"
    for c in ${LEVELS//,/ }; do
      echo "== c=$c x ${DURATION}s =="
      bench --concurrency "$c" --requests "$c" --warmup 0 --workload english \
        --max-duration "$DURATION" --fixed-duration --json "$OUTP/c$c.json"
    done
  } 2>&1 | tee "$OUTP/bench.log" | grep -E "^(==|system|----|grpc|first audio|summary|error)"
  curl -s "http://127.0.0.1:$METRICS/metrics" | grep -E '^tts_(stream_slots|frames_total|engine_healthy)' \
    | tee -a "$OUTP/env.txt"
  tail -5 "$OUTP/server.log"
  exit 0
fi

$PY - "$PORT" "$METRICS" "$OUTP/fault.json" "${LONG_S:-60}" <<'EOF'
"""16 long streams spread over both engines (their client reads one chunk, then pauses: the
streams hold their slots), then `kill-gpu` faults the engine it lands on."""
import asyncio, json, sys, urllib.request
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from tts_client.client import TTSClient, build_request

port, metrics_port, out, long_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
address = f"127.0.0.1:{port}"

def scrape():
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return {(s.name, s.labels.get("device", "")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}

async def outcome(client, req):
    try:
        res = await client.synthesize(req, timeout=120)
        return "OK", res.summary.num_frames
    except grpc.aio.AioRpcError as e:
        return e.code().name, e.details()

async def finish(call):
    try:
        while (msg := await call.read()) is not grpc.aio.EOF:
            last = msg
        return "OK", last.summary.num_frames
    except grpc.aio.AioRpcError as e:
        return e.code().name, e.details()

async def main():
    # no BDP probing: a 64 KiB window, so the server feels that these clients stopped reading
    async with TTSClient(address, options=[("grpc.http2.bdp_probe", 0)]) as slow, \
            TTSClient(address) as client:
        calls = [slow.stream(build_request(f"Stream {i} runs for a while.", max_duration_s=long_s,
                                           seed=i)) for i in range(16)]
        for call in calls:
            await call.read()  # in flight on one of the engines
        # the engine process sends its metric snapshots once a period: wait for all 16
        for _ in range(50):
            before = scrape()
            if sum(v for (n, _), v in before.items() if n == "tts_active_streams") >= 16:
                break
            await asyncio.sleep(0.2)
        killed = await outcome(client, build_request("Fault this GPU.", max_duration_s=8,
                                                     request_id="kill-gpu"))
        results = await asyncio.gather(*(finish(c) for c in calls))
        after_fault = await outcome(client, build_request("Still serving?", max_duration_s=1))
        async with grpc.aio.insecure_channel(address) as ch:
            health = (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())).status
        after = scrape()
    active = {d: v for (n, d), v in before.items() if n == "tts_active_streams"}
    healthy = {d: v for (n, d), v in after.items() if n == "tts_engine_healthy"}
    failed = sum(1 for r in results if r[0] == "UNAVAILABLE")
    dead = [d for d, v in healthy.items() if v == 0]
    report = dict(active_before=active, killed=killed, results=results, after_fault=after_fault,
                  health=health_pb2.HealthCheckResponse.ServingStatus.Name(health),
                  engine_healthy=healthy, failed=failed,
                  ok=sum(1 for r in results if r[0] == "OK"))
    checks = dict(one_engine_dead=len(dead) == 1, killed_unavailable=killed[0] == "UNAVAILABLE",
                  failed_equals_dead_engines_streams=bool(dead) and failed == active.get(dead[0], -1),
                  others_ok=report["ok"] == 16 - failed, new_request_ok=after_fault[0] == "OK",
                  still_serving=report["health"] == "SERVING")
    report["checks"] = checks
    json.dump(report, open(out, "w"), indent=1)
    print(json.dumps(report, indent=1))
    sys.exit(0 if all(checks.values()) else 1)

asyncio.run(main())
EOF
rc=$?
tail -8 "$OUTP/server.log"
exit $rc
