"""How fast a grpc.aio server takes in a burst of calls (CPU, no model): a server-streaming method
that notes when its handler starts, writes a few small messages ~80 ms apart (as audio chunks) and
returns; N calls at once from P client processes. Prints the spread of handler starts (first to
last) and the client-side time to the first message, per grpcio version and event loop: the
intake half of issue 18's 256-stream burst without the engine.

    python scripts/grpc_intake_bench.py [--calls 256] [--procs 8] [--loop uvloop|asyncio] [--servers 2]
        [--registered] [--shared-channel]   # a channel per call by default, as tts-bench
        [--no-metadata-first]   # the headers with the first message, not a batch of their own
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import time

import grpc

METHOD = "/bench.Intake/Stream"


def _serve(port: int, loop_kind: str, ready, starts_q, n_calls: int, chunks: int, registered: bool,
           servers: int, metadata_first: bool) -> None:
    if loop_kind == "uvloop":
        import uvloop
        uvloop.install()
    starts: list[float] = []

    async def stream(request: bytes, context):
        starts.append(time.monotonic())
        if metadata_first:  # as tts_server's servicer: headers before the first chunk, a batch of their own
            await context.send_initial_metadata((("x-request-id", "r"),))
        for _ in range(chunks):
            await context.write(b"\0" * 3840)  # 80 ms of 24 kHz s16 audio
            await asyncio.sleep(0.08)
        if len(starts) == n_calls:
            starts_q.put(starts)

    async def main():
        started = []
        for _ in range(servers):  # several servers on one port and one event loop: one accept loop each
            server = grpc.aio.server(options=[("grpc.so_reuseport", 1 if servers > 1 else 0)])
            handlers = {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Intake", handlers),))
            if registered:  # as generated stubs (and tts_server/rpc/server.py) do
                server.add_registered_method_handlers("bench.Intake", handlers)
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            started.append(server)
        ready.set()
        await started[0].wait_for_termination()

    asyncio.run(main())


def _client(port: int, n: int, go, out_q, shared_channel: bool) -> None:
    async def main():
        # a channel (connection) per call, as tts-bench's closed loop has; or one for all
        chans = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(1 if shared_channel else n)]
        for ch in chans:
            await ch.channel_ready()
        calls = [ch.unary_stream(METHOD) for ch in chans]
        go.wait()

        async def one(i):
            t0 = time.monotonic()
            first = None
            async for _ in calls[i % len(calls)](b"x"):
                if first is None:
                    first = time.monotonic() - t0
            return first

        out_q.put(await asyncio.gather(*(one(i) for i in range(n))))
        for ch in chans:
            await ch.close()

    asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=256)
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--loop", default="uvloop", choices=["uvloop", "asyncio"])
    ap.add_argument("--chunks", type=int, default=3)
    ap.add_argument("--port", type=int, default=50999)
    ap.add_argument("--registered", action="store_true", help="also add_registered_method_handlers")
    ap.add_argument("--servers", type=int, default=1, help="grpc.aio servers sharing the port in the one process")
    ap.add_argument("--shared-channel", action="store_true", help="one channel per client process, not per call")
    ap.add_argument("--no-metadata-first", dest="no_metadata", action="store_true",
                    help="no send_initial_metadata before the first message (headers go with it)")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    ready, go, starts_q, out_q = ctx.Event(), ctx.Event(), ctx.Queue(), ctx.Queue()
    srv = ctx.Process(target=_serve, args=(args.port, args.loop, ready, starts_q, args.calls, args.chunks, args.registered, args.servers, not args.no_metadata), daemon=True)
    srv.start()
    ready.wait(30)
    per = [args.calls // args.procs + (i < args.calls % args.procs) for i in range(args.procs)]
    clients = [ctx.Process(target=_client, args=(args.port, n, go, out_q, args.shared_channel), daemon=True)
               for n in per]
    for c in clients:
        c.start()
    time.sleep(2)  # channels ready
    go.set()
    firsts = [x for _ in clients for x in out_q.get(timeout=120)]
    starts = sorted(starts_q.get(timeout=60))
    for c in clients:
        c.join(10)
    srv.terminate()
    spread = [(t - starts[0]) * 1e3 for t in starts]
    ms = sorted(f * 1e3 for f in firsts)
    print(json.dumps({"grpcio": grpc.__version__, "loop": args.loop, "registered": args.registered, "servers": args.servers, "shared_channel": args.shared_channel, "metadata_first": not args.no_metadata, "calls": args.calls, "procs": args.procs,
                      "handler_start_spread_ms": {"p50": round(spread[len(spread) // 2], 1), "max": round(spread[-1], 1)},
                      "per_call_ms": round(spread[-1] / max(1, len(spread) - 1), 3),
                      "first_message_ms": {"p50": round(statistics.median(ms), 1),
                                           "p95": round(ms[int(0.95 * (len(ms) - 1))], 1), "max": round(ms[-1], 1)}}))


if __name__ == "__main__":
    main()
