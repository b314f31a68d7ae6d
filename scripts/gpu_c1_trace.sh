#!/usr/bin/env bash
# Where one stream's first audio goes on the GPU machine, in one call: the GPU suite (PRE_TESTS,
# a pytest file list; empty skips it), gpu_c1_profile.py with TRACE traced requests (kernels and
# runtime calls -> trace.json.gz; trace_gaps.py's idle gaps of request 0), the kernel profile of a
# one-prompt admission (gpu_prefill_profile.py), and INTAKE=1 the RPC intake micro-bench
# (grpc_intake_bench.py, the image's grpcio; 1 vs 2 aio servers, interleaved). Results under $OUT.
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
echo "commit ${COMMIT:-?}; $($PY -c 'import torch, triton, grpc; print(torch.__version__, triton.__version__, grpc.__version__)')" \
  | tee -a "$OUT/env.txt"
if [ -n "${PRE_TESTS:-}" ]; then
  timeout 400 $PY -m pytest -m gpu -q -p no:cacheprovider $PRE_TESTS > "$OUT/gpu-tests.log" 2>&1
  echo "gpu tests rc=$?: $(tail -1 "$OUT/gpu-tests.log")"
fi
timeout 200 $PY scripts/gpu_c1_profile.py --out "$OUT/c1" --requests "${REQUESTS:-30}" --trace "${TRACE:-2}" \
  > "$OUT/c1.log" 2>&1
echo "c1 profile rc=$?: $(grep 'median ms' "$OUT/c1.log" | cut -c1-600)"
if [ -f "$OUT/c1/trace.json" ]; then
  $PY scripts/trace_gaps.py "$OUT/c1/trace.json" --min-us 15 > "$OUT/c1/gaps.txt" 2>&1
  head -40 "$OUT/c1/gaps.txt"
  gzip -f "$OUT/c1/trace.json"
fi
timeout 150 $PY scripts/gpu_prefill_profile.py --out "$OUT/prefill1" --max-streams 8 --batches 1,4 \
  --profile-prompts "${PROFILE_PROMPTS:-1}" --repeats 10 > "$OUT/prefill1.log" 2>&1
echo "prefill profile rc=$?"; grep -E "^[0-9]+ \{|gpu_us_total" "$OUT/prefill1.log" | head
if [ "${INTAKE:-1}" = 1 ]; then
  for r in 1 2; do
    for s in 1 2; do
      echo "intake round $r servers $s: $(timeout 60 $PY scripts/grpc_intake_bench.py --servers $s 2>&1 | tail -2 | tr '\n' ' ' | cut -c1-400)"
    done
  done
fi
