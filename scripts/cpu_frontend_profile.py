"""The server process's own cost per call, on the CPU, with no model: the real grpc.aio server and
servicer over a paced fake engine (chunks posted on the engine's schedule: the first at once, then
every 80 ms frame in chunks of 1, 2, 4, 8 frames), driven by `tts-bench` from another process.

With the engines in their own process (`--engine-process`), this is what the server process
does for every call: accept it, validate, submit, and write its chunks. Prints the server
process's CPU time per call (all threads, the fake engine's included) and the event loop
thread's, and the client's TTFC (here: accept + handler + first write + client,
no synthesis); `--profile` adds the event loop's hot spots (cProfile).

    .venv/bin/python scripts/cpu_frontend_profile.py --streams 256 --seconds 2 --profile
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tts_server.api import AudioChunk, FinishReason, ModelInfo, StreamEnd  # noqa: E402
from tts_server.config import ServerConfig  # noqa: E402
from tts_server.metrics import Metrics  # noqa: E402
from tts_server.serving.streams import StreamHandle  # noqa: E402

FRAME_S, SAMPLES_PER_FRAME, CHUNKS = 0.08, 1920, (1, 2, 4, 8)


class PacedWorker:
    """The Worker interface with no engine: every stream gets its frames on a real-time clock."""

    def __init__(self, max_streams: int):
        self.max_streams = max_streams
        self.metrics = Metrics()
        self.failure = None
        self.watchdog_tick = None
        self._streams: dict = {}  # handle -> [frames made, frames sent, next frame time, chunks]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._frame = np.linspace(-0.5, 0.5, SAMPLES_PER_FRAME, dtype=np.float32)
        threading.Thread(target=self._run, name="paced-engine", daemon=True).start()

    num_outstanding = property(lambda self: len(self._streams))

    def add_fatal_listener(self, fn) -> None:
        pass

    def submit(self, request, loop):
        handle = StreamHandle(request, loop, lambda: None)
        with self._lock:
            self._streams[handle] = [0, 0, time.monotonic(), 0]
        return handle

    def stop(self, timeout=None) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            now, by_loop = time.monotonic(), {}
            with self._lock:
                items = list(self._streams.items())
            for handle, st in items:
                if handle.cancelled:
                    with self._lock:
                        self._streams.pop(handle, None)
                    continue
                while st[2] <= now and st[0] < handle.request.max_frames:
                    st[0] += 1
                    st[2] += FRAME_S
                pending = st[0] - st[1]
                last = st[0] >= handle.request.max_frames
                want = CHUNKS[min(st[3], len(CHUNKS) - 1)]
                events = []
                if pending and (pending >= want or last):
                    events.append(AudioChunk(np.tile(self._frame, pending), st[1] * SAMPLES_PER_FRAME,
                                             pending, st[3]))
                    st[1], st[3] = st[0], st[3] + 1
                if last and st[1] == st[0]:
                    events.append(StreamEnd(FinishReason.MAX_LENGTH, st[0], st[0] * SAMPLES_PER_FRAME))
                    with self._lock:
                        self._streams.pop(handle, None)
                if events:
                    by_loop.setdefault(handle._loop, []).extend((handle, e) for e in events)
            for loop, pairs in by_loop.items():
                loop.call_soon_threadsafe(_deliver, pairs)


def _deliver(pairs) -> None:
    for handle, event in pairs:
        if handle.account(event):
            handle._queue.put_nowait(event)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--seconds", type=float, default=2.0, help="audio per stream")
    p.add_argument("--processes", type=int, default=1, help="tts-bench load processes")
    p.add_argument("--profile", action="store_true", help="cProfile the event loop's thread")
    p.add_argument("--sort", default="tottime", help="pstats order (tottime, cumulative)")
    p.add_argument("--top", type=int, default=30, help="profile lines printed")
    p.add_argument("--json", help="write the numbers here")
    a = p.parse_args()
    from tts_server.rpc.server import TTSServer

    info = ModelInfo(name="paced", model_type="custom_voice", model_size="0b6", is_synthetic=True,
                     warning="", engine="paced", device="cpu", dtype="float32", sample_rate=24000,
                     frame_rate=12.5, voices=("aiden",), default_voice="aiden", languages=("english",))
    config = ServerConfig(port=0, http_port=-1, metrics_port=-1, max_streams=a.streams)
    worker = PacedWorker(a.streams)
    server = TTSServer(worker, info, config)
    await server.start()
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    cmd = [sys.executable, "-m", "tts_client.bench", "--address", f"127.0.0.1:{server.port}",
           "--concurrency", str(a.streams), "--requests", str(a.streams), "--warmup", "0",
           "--workload", "english", "--max-duration", str(a.seconds), "--fixed-duration",
           "--processes", str(a.processes), "--transport", "grpc", "--no-progress", "--json", out]
    prof = cProfile.Profile() if a.profile else None
    cpu0, loop0, wall0 = time.process_time(), time.thread_time(), time.perf_counter()
    if prof:
        prof.enable()
    bench = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE,
                                                 stderr=asyncio.subprocess.STDOUT)
    log = (await bench.communicate())[0].decode()
    if prof:
        prof.disable()
    cpu, loop_cpu, wall = (time.process_time() - cpu0, time.thread_time() - loop0,
                           time.perf_counter() - wall0)
    await server.stop(grace=1.0)
    worker.stop()
    level = json.load(open(out))["levels"][0]
    result = {"streams": a.streams, "seconds": a.seconds, "processes": a.processes,
              "ok": level["num_ok"], "server_cpu_s": round(cpu, 3), "wall_s": round(wall, 2),
              "server_cpu_ms_per_call": round(cpu / a.streams * 1e3, 2),
              "event_loop_cpu_ms_per_call": round(loop_cpu / a.streams * 1e3, 2),
              "ttfc_ms_p50": round(level["ttfc_ms_p50"], 1), "ttfc_ms_p95": round(level["ttfc_ms_p95"], 1),
              "underrun_rate": level["underrun_rate"]}
    print(json.dumps(result))
    if level["num_ok"] != a.streams:
        print(log[-3000:])
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(a.sort).print_stats(a.top)
        print(s.getvalue())
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
