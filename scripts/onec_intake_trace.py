"""Where a burst of calls over one gRPC connection spends the RPC process's event loop (CPU, no
model): the real server side of `--engine-process` (TTSServer over a RemoteWorker, logging at
INFO as served, start-up objects frozen) in this process, the paced stand-in engine in its
engine process, `tts-bench` with every call on one connection from another process.

Prints, per call: when its handler started, its submit, its first audio event on the loop and
that chunk's write (ms after the first handler start); the intake window (first to last handler
start) with the loop thread's CPU time in it, split into the parts this repo's code does
(request parsing and checks, submit, the engine pipe's reader, chunk messages, garbage
collection); the rest is grpc's and asyncio's. `--tree DIR` runs another tree's server (e.g.
`git archive <rev> tts_server tts_client | tar -x -C .base`) under the same measurement.

    python scripts/onec_intake_trace.py [--calls 256] [--connections 1] [--tree .base]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import sys
import tempfile
import time

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--calls", type=int, default=256)
ap.add_argument("--connections", type=int, default=1)
ap.add_argument("--seconds", type=float, default=2.0, help="audio per call")
ap.add_argument("--tree", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                help="the tree whose tts_server runs (default: this one)")
ap.add_argument("--label", default="", help="a name for the JSON line")
A = ap.parse_args()
sys.path.insert(0, os.path.abspath(A.tree))
os.environ["PYTHONPATH"] = os.path.abspath(A.tree) + os.pathsep + os.environ.get("PYTHONPATH", "")
os.environ["TTS_ENGINE_FACTORY"] = "tts_server.testing.paced:build"

from tts_server import aio  # noqa: E402
from tts_server.config import ServerConfig  # noqa: E402
from tts_server.logs import setup_logging  # noqa: E402
from tts_server.rpc import convert  # noqa: E402
from tts_server.rpc import servicer as servicer_module  # noqa: E402
from tts_server.rpc.server import TTSServer  # noqa: E402
from tts_server.serving import ipc  # noqa: E402
from tts_server.serving.remote import RemoteHandle, RemoteWorker  # noqa: E402

MARKS: dict[str, dict[str, float]] = {}  # stage -> request id -> monotonic time
PARTS: dict[str, float] = {}  # loop-thread CPU seconds per part, over the intake window
CPU: list[tuple[float, float]] = []  # (wall, loop thread CPU) at each handler start
FROZEN: dict[str, float] = {}


def mark(stage: str, rid: str) -> None:
    MARKS.setdefault(stage, {}).setdefault(rid, time.monotonic())


def timed(owner, name: str, part: str) -> None:
    fn = getattr(owner, name)

    def wrapper(*a, **k):
        t = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            PARTS[part] = PARTS.get(part, 0.0) + time.thread_time() - t

    setattr(owner, name, wrapper)


for owner, name, part in ((convert, "parse_synthesize_request", "parse"), (convert, "to_request", "to_request"),
                          (convert, "chunk_message", "chunk_message"), (RemoteWorker, "submit", "submit"),
                          (ipc.LoopReader, "_readable", "pipe_read"), (RemoteHandle, "mark_sent", "mark_sent"),
                          (logging.Logger, "info", "log_info")):
    timed(owner, name, part)

_gc_started = [0.0]


def _gc(phase, info):
    if phase == "start":
        _gc_started[0] = time.thread_time()
    else:
        key = f"gc_gen{info['generation']}"
        PARTS[key] = PARTS.get(key, 0.0) + time.thread_time() - _gc_started[0]


gc.callbacks.append(_gc)

_synthesize = servicer_module.TextToSpeechServicer._synthesize


async def _traced_synthesize(self, request, context, request_id):
    n = len(MARKS.get("start", ()))
    if n == 0:
        PARTS.clear()
    elif n == A.calls - 1:
        FROZEN.update(PARTS)
    mark("start", request_id)
    CPU.append((time.monotonic(), time.thread_time()))
    return await _synthesize(self, request, context, request_id)


servicer_module.TextToSpeechServicer._synthesize = _traced_synthesize
_submit, _deliver, _mark_sent = RemoteWorker.submit, RemoteHandle.deliver, RemoteHandle.mark_sent


def _traced_submit(self, req, loop):
    handle = _submit(self, req, loop)
    mark("submit", req.request_id)
    return handle


def _traced_deliver(self, event):
    mark("event", self.request.request_id)
    return _deliver(self, event)


def _traced_mark_sent(self, n):
    mark("written", self.request.request_id)
    return _mark_sent(self, n)


RemoteWorker.submit, RemoteHandle.deliver, RemoteHandle.mark_sent = _traced_submit, _traced_deliver, _traced_mark_sent


def pct(xs, q):
    xs = sorted(xs)
    return round(xs[int(q * (len(xs) - 1))], 1)


async def main() -> None:
    config = ServerConfig(port=0, http_port=-1, metrics_port=-1, max_streams=A.calls, engine_process=True,
                          rpc_processes=1, model="synthetic-tiny", device="cpu")
    proc, pipes = RemoteWorker.spawn(config)
    worker = await asyncio.to_thread(RemoteWorker.connect, proc, pipes[0], True)
    worker.start()
    aio.freeze_start_up_objects()  # as the server's start-up does
    server = TTSServer(worker, worker.info, config)
    await server.start()
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    cmd = [sys.executable, "-m", "tts_client.bench", "--address", f"127.0.0.1:{server.port}",
           "--concurrency", str(A.calls), "--requests", str(A.calls), "--warmup", "0", "--workload", "english",
           "--max-duration", str(A.seconds), "--fixed-duration", "--processes", "1", "--transport", "grpc",
           "--connections", str(A.connections), "--no-progress", "--json", out]
    bench = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE,
                                                 stderr=asyncio.subprocess.STDOUT)
    log = (await bench.communicate())[0].decode()
    await server.stop(grace=1.0)
    with open(out) as f:
        level = json.load(f)["levels"][0]
    ids = list(MARKS["start"])
    t0 = min(MARKS["start"].values())
    (w0, c0), (w1, c1) = CPU[0], CPU[-1]
    res = {"label": A.label, "tree": A.tree, "calls": A.calls, "ok": level["num_ok"],
           "ttfc_ms_p50": round(level["ttfc_ms_p50"], 1), "ttfc_ms_p95": round(level["ttfc_ms_p95"], 1),
           "intake_ms": round((w1 - w0) * 1e3, 1), "intake_loop_cpu_ms": round((c1 - c0) * 1e3, 1),
           "intake_parts_ms": {k: round(v * 1e3, 1) for k, v in sorted(FROZEN.items())}}
    for stage in ("start", "event", "written"):
        res[f"{stage}_ms_p50_p95"] = [pct([(MARKS[stage][i] - t0) * 1e3 for i in ids if i in MARKS.get(stage, {})], q)
                                      for q in (0.5, 0.95)]
    res["start_to_written_ms_p50_p95"] = [pct([(MARKS["written"][i] - MARKS["start"][i]) * 1e3 for i in ids
                                               if i in MARKS.get("written", {})], q) for q in (0.5, 0.95)]
    print(json.dumps(res))
    if level["num_ok"] != A.calls:
        print(log[-2000:], file=sys.stderr)


setup_logging("INFO")  # as served: the handlers' log lines cost what they cost there
logging.getLogger().handlers[0].setStream(open(os.devnull, "w"))
aio.run(main(), "uvloop")
