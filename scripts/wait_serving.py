"""Waits until the tts-server on 127.0.0.1:PORT answers grpc.health.v1 SERVING; exit 1 if its
process PID ends first or TIMEOUT_S passes. Usage: python3 scripts/wait_serving.py PORT PID [TIMEOUT_S]"""

import os
import sys
import time

import grpc

port, pid = sys.argv[1], int(sys.argv[2])
deadline = time.time() + (float(sys.argv[3]) if len(sys.argv) > 3 else 420)
with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
    check = ch.unary_unary("/grpc.health.v1.Health/Check")
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except OSError:
            sys.exit(1)
        try:
            if check(b"", timeout=2) == b"\x08\x01":  # HealthCheckResponse{status: SERVING}
                sys.exit(0)
        except grpc.RpcError:
            pass
        time.sleep(0.5)
sys.exit(1)
