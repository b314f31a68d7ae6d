#!/usr/bin/env bash
# A/B of first audio at one stream on one GPU machine, in one call: for each source tree given
# (default: the working tree), a server with --max-streams 8 (short start-up) and tts-bench c = 1
# (30 English prompts). Trees other than "." are folders holding another commit's checkout, e.g.
#   git archive <commit> --prefix=ab_old/ | tar x      (then: bash scripts/gpu_ab_c1.sh ab_old .)
# Results: $OUT/ab-<n>-{server.log,c1.json,bench.log}; the breakdown lines print last.
source "$(dirname "$0")/gpu_env.sh"
SITE=${PYTHONPATH:-}
PORT=${PORT:-50078}
n=0
for tree in "${@:-.}"; do
  n=$((n + 1))
  export PYTHONPATH=$ROOT/$tree${SITE:+:$SITE}
  (cd "$ROOT/$tree" && exec $PY -m tts_server --port "$((PORT + n))" --model synthetic --metrics-port -1 --max-streams 8 \
      >"$OUT/ab-$n-server.log" 2>&1) &
  server=$!
  for _ in $(seq 1 400); do
    grep -q "serving tts.v1" "$OUT/ab-$n-server.log" 2>/dev/null && break
    kill -0 $server 2>/dev/null || break
    sleep 1
  done
  (cd "$ROOT/$tree" && timeout 150 $PY -m tts_client.bench --address "127.0.0.1:$((PORT + n))" --no-progress \
      --concurrency 1 --requests 30 --warmup 3 --workload english --max-duration 2 \
      --json "$OUT/ab-$n-c1.json") >"$OUT/ab-$n-bench.log" 2>&1
  kill -TERM $server 2>/dev/null; wait $server 2>/dev/null  # the server itself (exec), drained
  echo "== $tree: $(grep -E '^grpc' "$OUT/ab-$n-bench.log")"
  grep "first audio p50" "$OUT/ab-$n-bench.log"
done
