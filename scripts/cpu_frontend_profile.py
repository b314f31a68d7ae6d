"""The server process's own cost per call, on the CPU, with no model: the real grpc.aio server and
servicer over a paced fake engine (chunks posted on the engine's schedule: the first at once, then
every 80 ms frame in chunks of 1, 2, 4, 8 frames), driven by `tts-bench` from another process.

With the engines in their own process (`--engine-process`), this is what the server process
does for every call: accept it, validate, submit, and write its chunks. Prints the server
process's CPU time per call (all threads, the fake engine's included) and the event loop
thread's, and the client's TTFC (here: accept + handler + first write + client,
no synthesis); `--profile` adds the event loop's hot spots (cProfile).

    .venv/bin/python scripts/cpu_frontend_profile.py --streams 256 --seconds 2 --profile
    .venv/bin/python scripts/cpu_frontend_profile.py --streams 256 --rpc-processes 2
    .venv/bin/python scripts/cpu_frontend_profile.py --streams 256 [--uvloop | --rpc-processes 1 --event-loop asyncio]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tts_server.config import ServerConfig  # noqa: E402
from tts_server.testing.paced import INFO, PacedWorker  # noqa: E402


def bench_cmd(port: int, a, out: str, http_port: int | None = None) -> list[str]:
    http = ["--http-url", f"http://127.0.0.1:{http_port}"] if http_port else []
    return [sys.executable, "-m", "tts_client.bench", "--address", f"127.0.0.1:{port}", *http,
            "--concurrency", str(a.streams), "--requests", str(a.streams), "--warmup", "0",
            "--workload", "english", "--max-duration", str(a.seconds), "--fixed-duration",
            "--processes", str(a.processes), "--transport", a.transport, "--connections", str(a.connections),
            "--no-progress", "--json", out]


def level_of(out: str) -> dict:
    with open(out) as f:
        return json.load(f)["levels"][0]


def _children_cpu() -> float:
    """User + system CPU seconds of this process's reaped children (and theirs): the load
    generator's, measured across its run (the server is reaped only at the end)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


async def cli_server(a) -> dict:
    """`tts-server --engine-process --rpc-processes N` with the paced engine in its engine process."""
    from tts_client.bench import ServerProcess

    env = dict(os.environ, TTS_ENGINE_FACTORY="tts_server.testing.paced:build")
    os.environ.update(env)  # ServerProcess inherits it
    http = () if a.transport == "http" else ("--http-port", "-1")
    server = ServerProcess("synthetic-tiny", "torch", a.streams,
                           ("--device", "cpu", "--engine-process", *http, "--rpc-processes",
                            str(a.rpc_processes), "--metrics-port", "-1", "--event-loop", a.event_loop))
    try:
        await server.wait_serving(120)
        await asyncio.sleep(1.0)  # the extra RPC processes bind a moment later
        out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
        t0, client0 = time.perf_counter(), _children_cpu()
        bench = await asyncio.create_subprocess_exec(
            *bench_cmd(server.port, a, out, server.http_port if a.transport == "http" else None),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        log = (await bench.communicate())[0].decode()
        wall, client_cpu = time.perf_counter() - t0, _children_cpu() - client0
    finally:
        server.stop()
    level = level_of(out)
    if level["num_ok"] != a.streams:
        print(log[-3000:])
    return {"streams": a.streams, "seconds": a.seconds, "processes": a.processes, "transport": a.transport,
            "rpc_processes": a.rpc_processes, "ok": level["num_ok"], "wall_s": round(wall, 2),
            "client_cpu_s": round(client_cpu, 2),
            "ttfc_ms_p50": round(level["ttfc_ms_p50"], 1), "ttfc_ms_p95": round(level["ttfc_ms_p95"], 1)}


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--seconds", type=float, default=2.0, help="audio per stream")
    p.add_argument("--processes", type=int, default=1, help="tts-bench load processes")
    p.add_argument("--profile", action="store_true", help="cProfile the event loop's thread")
    p.add_argument("--sort", default="tottime", help="pstats order (tottime, cumulative)")
    p.add_argument("--top", type=int, default=30, help="profile lines printed")
    p.add_argument("--rpc-processes", type=int, default=0,
                   help="0: the servicer in this process over the paced worker (CPU time, "
                        "--profile); N: a real `tts-server --engine-process --rpc-processes N` "
                        "with the paced engine in its engine process (TTFC only)")
    p.add_argument("--transport", default="grpc", choices=["grpc", "http"],
                   help="the calls through gRPC or the OpenAI-compatible HTTP API")
    p.add_argument("--connections", type=int, default=0,
                   help="gRPC: the burst's calls share this many connections (tts-bench --connections; 0: one each)")
    p.add_argument("--json", help="write the numbers here")
    p.add_argument("--uvloop", action="store_true", help="the in-process server on uvloop (else asyncio's)")
    p.add_argument("--event-loop", default="auto", help="the CLI server's --event-loop (--rpc-processes N)")
    a = p.parse_args()
    if a.rpc_processes:
        result = await cli_server(a)
        print(json.dumps(result))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(result, f, indent=1)
        return
    from tts_server.rpc.server import TTSServer

    info = INFO
    config = ServerConfig(port=0, http_port=0 if a.transport == "http" else -1, metrics_port=-1,
                          max_streams=a.streams)
    worker = PacedWorker(a.streams)
    server = TTSServer(worker, info, config)
    await server.start()
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    cmd = bench_cmd(server.port, a, out, server.http_port)
    prof = cProfile.Profile() if a.profile else None
    cpu0, loop0, wall0, client0 = time.process_time(), time.thread_time(), time.perf_counter(), _children_cpu()
    if prof:
        prof.enable()
    bench = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE,
                                                 stderr=asyncio.subprocess.STDOUT)
    log = (await bench.communicate())[0].decode()
    if prof:
        prof.disable()
    cpu, loop_cpu, wall = (time.process_time() - cpu0, time.thread_time() - loop0,
                           time.perf_counter() - wall0)
    client_cpu = _children_cpu() - client0
    await server.stop(grace=1.0)
    worker.stop()
    level = level_of(out)
    result = {"streams": a.streams, "seconds": a.seconds, "processes": a.processes,
              "ok": level["num_ok"], "server_cpu_s": round(cpu, 3), "wall_s": round(wall, 2),
              "client_cpu_s": round(client_cpu, 2),
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
    from tts_server import aio

    aio.run(main(), "uvloop" if "--uvloop" in sys.argv else "asyncio")  # the in-process server's loop
