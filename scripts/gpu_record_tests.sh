#!/usr/bin/env bash
# One device call for a session's evidence: the standard record of this tree (gpu_server_bench.sh,
# issue 18's acceptance; its variables pass through, COMMIT=<hash> names the tree) packed as
# $OUT/record.tar.gz, then the GPU tests named in TESTS (bounded by TESTS_TIMEOUT s, log in
# $OUT/tests.log), and the Triton cache as $OUT/triton-cache.tgz to carry into the next call
# (.triton-cache/cache.tgz; gpu_env.sh unpacks it). RECORD=0: the tests alone.
source "$(dirname "$0")/gpu_env.sh"
if [ "${RECORD:-1}" = 1 ]; then
  rm -rf /tmp/record && mkdir -p /tmp/record
  OUT=/tmp/record bash scripts/gpu_server_bench.sh
  tar -czf "$OUT/record.tar.gz" -C /tmp record
  save_triton_cache
fi
if [ -n "${TESTS:-}" ]; then
  timeout "${TESTS_TIMEOUT:-200}" $PY -m pytest -m gpu -q -p no:cacheprovider $TESTS 2>&1 | tee "$OUT/tests.log" | tail -25
  save_triton_cache
fi
