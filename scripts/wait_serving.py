"""Waits until the tts-server on 127.0.0.1:PORT answers grpc.health.v1 SERVING; exit 1 if its
process PID ends first or TIMEOUT_S passes. Usage: python3 scripts/wait_serving.py PORT PID [TIMEOUT_S]
(tts_client.bench.wait_for_serving: its channel retries the connection every second at most, so
the answer comes within ~1 s of the server's start, however long that took)."""

import asyncio
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tts_client.bench import wait_for_serving  # noqa: E402

port, pid = sys.argv[1], int(sys.argv[2])
timeout_s = float(sys.argv[3]) if len(sys.argv) > 3 else 420


def exited():
    try:
        os.kill(pid, 0)
    except OSError:
        return f"process {pid} ended"
    return None


try:
    sys.exit(0 if asyncio.run(wait_for_serving(f"127.0.0.1:{port}", timeout_s, exited)) else 1)
except RuntimeError:
    sys.exit(1)
