#!/usr/bin/env bash
# CPU only, on the device host: 256-call bursts against the real `tts-server --engine-process
# --rpc-processes N` (default 4, as --rpc-processes auto on 16 cores) over the paced stand-in
# engine, through gRPC (a connection per call, and all on one) and the HTTP API, from 1 and 8
# load processes; each line has the load generator's own CPU seconds (client_cpu_s), to tell a
# client-bound burst from a server-bound one. JSON lines in $OUT/bursts.jsonl.
source "$(dirname "$0")/gpu_env.sh"
mkdir -p /tmp/avstub/av && echo 'raise ImportError("PyAV stub")' > /tmp/avstub/av/__init__.py
export PYTHONPATH=$(pwd):/tmp/avstub:${PYTHONPATH:-}
RPC=${RPC:-4}
for r in $(seq ${ROUNDS:-2}); do
  for v in "--transport http --processes 1" "--transport http --processes 8" "--transport grpc --processes 1" \
           "--transport grpc --processes 1 --connections 1"; do
    timeout 200 $PY scripts/cpu_frontend_profile.py --streams 256 --rpc-processes $RPC $v 2>>$OUT/bursts.err \
      | tail -1 | sed "s/^{/{\"args\": \"$v\", /" | tee -a $OUT/bursts.jsonl
  done
done
