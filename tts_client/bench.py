"""`tts-bench`: time to first audio, real-time factor and playback underruns measured through the
gRPC client, closed loop (c concurrent clients) and open loop (Poisson arrivals at R requests/s),
beside the unmodified qwen-tts generate path in the same run; the largest load with zero underruns
is reported as the capacity."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

import grpc
from google.protobuf.json_format import MessageToDict

from .client import TTSClient, build_request
from .helpfmt import ArgumentParser
from .pb.tts.v1 import tts_pb2
from .stats import RequestRecord, capacity, format_table, summarize, summary_line
from .workloads import WORKLOADS, load_text_file, open_loop, poisson_arrivals, schedule

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
SERVING = b"\x08\x01"  # HealthCheckResponse{status: SERVING} in protobuf wire format
# A channel made before the server listens retries its connection with gRPC's backoff (1 s,
# growing 1.6x up to 120 s): after a GPU server's minutes of start-up, a poll on it saw SERVING
# up to two minutes late. Retried every second at most instead.
WAIT_CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                        ("grpc.max_reconnect_backoff_ms", 1000))


async def wait_for_serving(address: str, timeout_s: float, exited=lambda: None) -> bool:
    """Polls address's health service ("") until SERVING (True) or timeout_s (False); stops at
    once if exited() says the server is gone (raises RuntimeError with what it returned)."""
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(address, options=WAIT_CHANNEL_OPTIONS) as channel:
        check = channel.unary_unary(HEALTH_CHECK)  # raw bytes in and out
        while time.monotonic() < deadline:
            gone = exited()
            if gone is not None:
                raise RuntimeError(gone)
            try:
                if await check(b"", timeout=2.0) == SERVING:
                    return True
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.5)
    return False


class Progress:
    """A dependency-free progress bar on stderr (one line per finished stage when not a tty)."""

    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.label, self.done, self.errors = total, label, 0, 0
        self.enabled, self.is_tty, self.t0 = enabled, sys.stderr.isatty(), time.perf_counter()
        self.update(None)

    def update(self, ok: bool | None = True) -> None:
        """Counts a finished request (`ok` None only redraws)."""
        self.done += ok is not None
        self.errors += ok is False
        if self.enabled and (self.is_tty or self.done == self.total):
            filled = int(30 * self.done / max(self.total, 1))
            sys.stderr.write(f"\r{self.label:<14}[{'#' * filled}{'.' * (30 - filled)}] {self.done}/"
                             f"{self.total} errors {self.errors} {time.perf_counter() - self.t0:5.1f}s"
                             + ("\n" if self.done == self.total else ""))
            sys.stderr.flush()


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on now and that this process has not handed out before.

    Servers bind their ports seconds after they are given them, so without the memory two calls
    in a row (one server's admin port, the next one's gRPC port) could get the same port."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port


class ServerProcess:
    """`tts-server` as a subprocess on a free loopback port; stop() always reaps it."""

    def __init__(self, model: str, engine: str, max_streams: int, extra_args=(), max_queue: int = 0):
        # max_streams 0: the server's default (what fits on a GPU)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.http_port = free_port()  # the OpenAI-compatible HTTP API, on its own free port
        exe = os.path.join(os.path.dirname(sys.executable), "tts-server")
        cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "tts_server"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--http-port", str(self.http_port),
                "--model", model, "--engine", engine,
                "--max-queue", str(max_queue), *extra_args]
        if max_streams:
            cmd += ["--max-streams", str(max_streams)]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="tts-bench-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    async def wait_serving(self, timeout_s: float) -> None:
        """Polls the health service ("") until SERVING; raises if the server exits or times out."""
        def exited():
            if self.proc.poll() is not None:
                return f"tts-server exited with {self.proc.returncode}:\n{self.log_tail()}"
            return None

        if not await wait_for_serving(self.address, timeout_s, exited):
            raise TimeoutError(f"tts-server not SERVING after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, num_lines: int = 15) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-num_lines:])

    def stop(self) -> None:
        """SIGTERM (the server drains), SIGKILL after 30 s; idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


async def run_one(client: TTSClient, item, level: float, voice: str, frame_rate: float,
                  timeout: float, preroll_s: float, t_level: float, system: str = "grpc",
                  scheduled_s: float | None = None) -> RequestRecord:
    u = item.utterance
    rec = RequestRecord(system, level, item.index, u.text_id, u.language, len(u.text),
                        item.max_duration_s(frame_rate))
    tag = f"r{level:g}" if system == "grpc-rps" else f"c{level}"
    req = build_request(u.text, voice=voice, language=u.language, seed=item.seed,
                        max_duration_s=rec.max_duration_s, request_id=f"bench-{tag}-{item.index}")
    arrivals, durations, summary = [], [], None
    t0 = time.perf_counter()
    if scheduled_s is not None:
        rec.lag_ms = (t0 - t_level - scheduled_s) * 1000
    try:
        async for msg in client.chunks(req, timeout):
            if msg.HasField("audio"):
                arrivals.append(time.perf_counter() - t0)
                durations.append(msg.audio.num_samples / msg.audio.sample_rate_hz)
                rec.num_frames += msg.audio.num_frames
            else:
                summary = msg.summary
    except grpc.aio.AioRpcError as e:
        rec.status, rec.error = e.code().name, e.details() or ""
    t1 = time.perf_counter()
    rec.start_s, rec.end_s = t0 - t_level, t1 - t_level
    rec.add_trace(arrivals, durations, t1 - t0, preroll_s)
    if summary is not None:
        rec.server_ttfc_ms, rec.server_rtf = summary.time_to_first_chunk_ms, summary.real_time_factor
        if summary.HasField("first_audio"):
            rec.first_audio = MessageToDict(summary.first_audio, preserving_proto_field_name=True)
        name = tts_pb2.FinishReason.Name(summary.finish_reason)
        rec.finish_reason = name.removeprefix("FINISH_REASON_").lower()
    elif rec.status == "OK":
        rec.status, rec.error = "NO_SUMMARY", "stream ended without a summary"
    return rec


async def run_level(address: str, items, level: int, a, voice: str, frame_rate: float,
                    progress: Progress | None, num_clients: int | None = None,
                    start_at: float | None = None) -> list[RequestRecord]:
    """Closed loop: `level` clients (or `num_clients`: this process's share of them), each on its
    own channel (or, with `a.connections`, sharing that many connections, this process's share
    of them), send the next request as soon as their previous one ends, until `items` are used
    up. start_at: a unix time to start at once the channels are ready (processes start together)."""
    lanes = min(num_clients or level, len(items))
    n_conn = lanes
    if a.connections:
        n_conn = max(1, min(lanes, round(a.connections * lanes / level)))
    clients = [TTSClient(address, options=[("grpc.use_local_subchannel_pool", 1)])
               for _ in range(n_conn)]
    try:
        await asyncio.gather(*(asyncio.wait_for(c.channel.channel_ready(), 30) for c in clients))
        if start_at is not None:
            late = time.time() - start_at
            if late > 0.05:
                print(f"warning: a load process started {late:.2f} s late", file=sys.stderr)
            await asyncio.sleep(max(0.0, -late))
        pending, records, t_level = iter(items), [], time.perf_counter()

        async def worker(client):
            for item in pending:
                rec = await run_one(client, item, level, voice, frame_rate, a.timeout,
                                    a.preroll_ms / 1000, t_level)
                records.append(rec)
                if progress:
                    progress.update(rec.status == "OK")

        await asyncio.gather(*(worker(clients[i % n_conn]) for i in range(lanes)))
        return sorted(records, key=lambda r: r.index)
    finally:
        await asyncio.gather(*(c.close() for c in clients))


async def _closed_level(address: str, http: tuple[str, str] | None, items, level: int, a, voice: str,
                        frame_rate: float, progress: Progress | None, num_clients: int | None = None,
                        start_at: float | None = None) -> list[RequestRecord]:
    """`run_level` over gRPC, or with http = (base URL, model) bench_http's over the HTTP API."""
    if http:
        from . import bench_http

        return await bench_http.run_level(*http, items, level, a, voice, frame_rate, progress,
                                          num_clients, start_at)
    return await run_level(address, items, level, a, voice, frame_rate, progress, num_clients, start_at)


def _level_share(address: str, items, level: int, num_clients: int, a, voice: str, frame_rate: float,
                 start_at: float, http: tuple[str, str] | None = None) -> list[RequestRecord]:
    """One load process's part of a closed-loop level (`--processes`)."""
    return asyncio.run(_closed_level(address, http, items, level, a, voice, frame_rate, None, num_clients,
                                     start_at))


async def run_level_processes(address: str, items, level: int, a, voice: str, frame_rate: float,
                              progress: Progress | None,
                              http: tuple[str, str] | None = None) -> list[RequestRecord]:
    """A closed-loop level driven by `a.processes` load processes (each with its own event loop
    and a share of the clients and requests), started together, so that one Python process's
    event loop does not delay the sends and reads of a large level; records merged by index.
    http: (base URL, model): the level through the HTTP API instead of gRPC."""
    n = min(a.processes, level, len(items))
    if n <= 1:
        return await _closed_level(address, http, items, level, a, voice, frame_rate, progress)
    shares = [(items[i::n], len(range(i, level, n))) for i in range(n)]
    start_at = time.time() + 5.0 + 0.02 * level  # spawn, imports, channels ready
    loop = asyncio.get_running_loop()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(n, mp_context=ctx) as pool:
        parts = await asyncio.gather(*(loop.run_in_executor(
            pool, _level_share, address, part, level, clients, a, voice, frame_rate, start_at, http)
            for part, clients in shares))
    records = sorted((r for part in parts for r in part), key=lambda r: r.index)
    if progress:
        for r in records:
            progress.update(r.status == "OK")
    return records


async def run_rate(address: str, items, rps: float, a, voice: str, frame_rate: float,
                   progress: Progress | None) -> list[RequestRecord]:
    """Open loop: the requests arrive as a Poisson process of `rps` per second (seeded), whatever
    the server's state, spread over `a.channels` channels; each arrival's lag behind its schedule
    is recorded (the load generator's own delay, not the server's)."""
    arrivals = poisson_arrivals(len(items), rps, a.seed)
    clients = [TTSClient(address, options=[("grpc.use_local_subchannel_pool", 1)])
               for _ in range(min(a.channels, len(items)))]
    try:
        await asyncio.gather(*(asyncio.wait_for(c.channel.channel_ready(), 30) for c in clients))
        return await open_loop(items, arrivals, lambda i, item, t_start: run_one(
            clients[i % len(clients)], item, rps, voice, frame_rate, a.timeout,
            a.preroll_ms / 1000, t_start, "grpc-rps", arrivals[i]), progress)
    finally:
        await asyncio.gather(*(c.close() for c in clients))


async def run_grpc(address: str, items, a, server: ServerProcess | None):
    """Waits for the server, warms it up, then sweeps the concurrency levels."""
    if server:
        await server.wait_serving(a.startup_timeout)
    async with TTSClient(address) as client:
        info = await client.model_info()
        voices = await client.list_voices()
    voice = a.voice or next((v.name for v in voices.voices if v.is_default), "")
    frame_rate = info.frame_rate_hz or 12.5
    levels = [int(x) for x in a.concurrency.split(",") if x]
    rates = [float(x) for x in (a.rps or "").split(",") if x]
    transports = ("grpc", "http") if a.transport == "both" else (a.transport,)
    if levels and max(levels) > info.max_concurrent_streams:
        print(f"note: the server allows {info.max_concurrent_streams} concurrent streams; requests "
              "beyond that are rejected (RESOURCE_EXHAUSTED) and counted as errors", file=sys.stderr)
    if a.warmup:
        await run_level(address, items[:a.warmup], 1, a, voice, frame_rate,
                        Progress(min(a.warmup, len(items)), "warm-up", a.progress))
    records = []
    if "grpc" in transports:
        for level in levels:
            records += await run_level_processes(address, items, level, a, voice, frame_rate,
                                                 Progress(len(items), f"grpc c={level}", a.progress))
        for rps in rates:
            records += await run_rate(address, items, rps, a, voice, frame_rate,
                                      Progress(len(items), f"grpc {rps:g}/s", a.progress))
    if "http" in transports:
        records += await _run_http(a, items, levels, rates, voice, frame_rate, server)
    return info, voice, records


async def _run_http(a, items, levels, rates, voice, frame_rate, server) -> list:
    """The same sweeps through the OpenAI-compatible HTTP API of the same server."""
    from . import bench_http

    base = a.http_url or (f"http://127.0.0.1:{server.http_port}" if server else
                          f"http://{a.address.rsplit(':', 1)[0]}:8000")
    async with bench_http._session(1) as session:
        model = await bench_http.served_model(session, base)
    records = []
    for level in levels:
        records += await run_level_processes(a.address, items, level, a, voice, frame_rate,
                                             Progress(len(items), f"http c={level}", a.progress),
                                             (base, model))
    for rps in rates:
        records += await bench_http.run_rate(base, model, items, rps, a, voice, frame_rate,
                                             Progress(len(items), f"http {rps:g}/s", a.progress))
    return records


def run_baseline(items, a, info, voice: str) -> list[RequestRecord]:
    """Runs `python -m tts_server.baseline` on the same requests and reads its JSON lines."""
    items = items[:a.baseline_requests or len(items)]
    sizes = [int(x) for x in a.baseline_concurrency.split(",") if x]
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for it in items:
            f.write(json.dumps(dict(index=it.index, text=it.utterance.text, voice=voice, seed=it.seed,
                                    language=it.utterance.language, max_frames=it.max_frames)) + "\n")
    cmd = [sys.executable, "-m", "tts_server.baseline", "--model", a.baseline_model or info.model,
           "--device", info.device or "auto", "--dtype", info.dtype or "auto", "--voice", voice,
           "--requests", f.name, "--batch-sizes", ",".join(map(str, sizes)),
           "--warmup", str(min(a.warmup, 1)), "--json-lines"]
    by_index, frame_rate = {it.index: it for it in items}, info.frame_rate_hz or 12.5
    progress = Progress(len(items) * len(sizes), "qwen-tts", a.progress)
    err = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    records = []
    try:
        for line in proc.stdout:
            r = json.loads(line)
            item, is_ok = by_index[r["index"]], r["status"] == "OK"
            u = item.utterance
            rec = RequestRecord("qwen-tts", r["concurrency"], item.index, u.text_id, u.language, len(u.text),
                                item.max_duration_s(frame_rate), status=r["status"], error=r["error"],
                                start_s=r["start_s"], end_s=r["end_s"], num_frames=r["num_frames"],
                                finish_reason=r["finish_reason"])
            wall_s = r["wall_ms"] / 1000  # the whole utterance arrives at once
            rec.add_trace([wall_s] if is_ok else [], [r["audio_s"]] if is_ok else [], wall_s)
            records.append(rec)
            progress.update(is_ok)
        if proc.wait() != 0:
            err.seek(0)
            raise RuntimeError(f"baseline exited with {proc.returncode}:\n{''.join(err.readlines()[-15:])}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        err.close()
        os.unlink(f.name)
    return records


def report(a, info, voice: str, items, records: list[RequestRecord], load_start: float) -> dict:
    """Aggregates per (system, level), compares with the baseline on the same requests, prints."""
    levels, comparisons = summarize(records)
    ok = [r for r in records if r.status == "OK"]
    capped = sum(r.finish_reason == "max_length" for r in ok)
    lanes = f"sharing {a.connections} connection(s)" if a.connections else "on separate channels"
    notes = [f"method: closed loop, c clients {lanes}; open loop (grpc-rps), Poisson "
             f"arrivals at R requests/s over {a.channels} channels (http: the same through the "
             f"OpenAI-compatible API, streamed PCM, one connection per stream); {len(items)} requests per level (same "
             f"texts and seeds at every level), {a.warmup} warm-up; TTFC = client send -> first audio "
             f"bytes; RTF = client wall / audio s; underrun = a player started {a.preroll_ms:.0f} ms after "
             "the first chunk (@0ms: at the first chunk) runs dry, stall max its longest total stall per "
             "request (then @0ms again); capacity = the largest level with "
             "every request OK and zero underruns; qwen-tts is non-streaming, so its TTFC is the whole "
             "utterance",
             f"caps: max_duration_s = min(spoken length, {a.max_duration:g} s) per request, sent explicitly "
             f"and used as max_new_tokens for qwen-tts; {capped}/{len(ok)} requests ran to the cap"]
    host = dict(cpu_count=os.cpu_count(), load_avg_1m_start=load_start, load_avg_1m_end=os.getloadavg()[0])
    if max(load_start, host["load_avg_1m_end"]) > (os.cpu_count() or 1):
        notes.append(f"host load average {load_start:.1f} -> {host['load_avg_1m_end']:.1f} on "
                     f"{os.cpu_count()} cores: other processes competed for the CPU, so timings are noisy")
    if info.is_synthetic:
        notes.append("synthetic random weights rarely emit EOS, so both sides usually run to the cap; "
                     "the audio is noise, only the speed is real")
    label = (f"{time.strftime('%Y-%m-%d')} {info.model} {info.engine}/{info.device}/{info.dtype} "
             f"cap {a.max_duration:g}s")
    caps = {system: capacity(levels, system) for system in ("grpc", "grpc-rps", "http", "http-rps")
            if any(x["system"] == system for x in levels)}
    line = summary_line(label, levels, comparisons)
    if caps:
        line += " | capacity (zero underruns at {:.0f} ms pre-roll): ".format(a.preroll_ms) + ", ".join(
            f"{k.split('-')[0]} {'rps' if k.endswith('-rps') else 'c'}={v if v is not None else 'none'}"
            for k, v in caps.items())
    print(format_table(levels))
    for x in levels:
        if x.get("first_audio_queue_ms_p50") is not None:
            key = "rps" if x["system"].endswith("-rps") else "c"
            parts = ("queue", "prepare", "prefill", "first_frame", "first_decode", "write")
            print(f"first audio p50 at {key}={x['concurrency']:g} (server ms): " + ", ".join(
                f"{p} {x[f'first_audio_{p}_ms_p50']:.1f}" for p in parts
                if x.get(f"first_audio_{p}_ms_p50") is not None)
                + f"; client TTFC p50 {x['ttfc_ms_p50']:.1f}"
                + (f" (outside the server p50 {x['outside_server_ms_p50']:.1f}, p95 {x['outside_server_ms_p95']:.1f})"
                   if x.get("outside_server_ms_p50") is not None else "")
                + f"; peak in flight {x['peak_in_flight']}"
                + (f"; generator lag p95 {x['lag_ms_p95']:.1f} ms" if key == "rps" else ""))
    for c in comparisons:
        print(f"qwen-tts/server at c={c['concurrency']} on the same {c['num_requests']} requests: TTFC p50 "
              f"{c['ttfc_p50_ratio'] or 0:.1f}x, RTF p50 {c['rtf_p50_ratio'] or 0:.1f}x, "
              f"throughput {c['throughput_ratio'] or 0:.1f}x in the server's favour")
    print("\n".join("note: " + n for n in notes))
    print("summary: " + line)
    return dict(schema="tts-bench/1", created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                config=vars(a), host=host, voice=voice, notes=notes,
                server=MessageToDict(info, preserving_proto_field_name=True), records=[asdict(r) for r in records], levels=levels,
                comparisons=comparisons, capacity=caps, summary=line)


def plot(result: dict, path: str) -> None:
    """TTFC and RTF (p50 and p95) vs concurrency, one line per system; skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print(f"note: matplotlib is not installed; no plot written to {path}", file=sys.stderr)
        return
    panels = [("concurrent streams", ("grpc", "http", "qwen-tts"))]
    if any(x["system"].endswith("-rps") for x in result["levels"]):
        panels.append(("requests per second (open loop)", ("grpc-rps", "http-rps")))
    fig, axes = plt.subplots(len(panels), 2, figsize=(11, 4.2 * len(panels)), squeeze=False)
    for (xlabel, systems), (ax1, ax2) in zip(panels, axes):
        for system, marker in zip(systems, "o^s"):
            rows = [x for x in result["levels"] if x["system"] == system and x["num_ok"]]
            cs = [x["concurrency"] for x in rows]
            for q, style in (("p50", "-"), ("p95", "--")):
                ax1.plot(cs, [x[f"ttfc_ms_{q}"] for x in rows], style, marker=marker, label=f"{system} {q}")
                ax2.plot(cs, [x[f"rtf_{q}"] for x in rows], style, marker=marker, label=f"{system} {q}")
        ax2.axhline(1.0, color="grey", lw=0.8)
        levels = sorted({x["concurrency"] for x in result["levels"] if x["system"] in systems})
        for ax, title in ((ax1, "time to first chunk (ms, client)"), (ax2, "real-time factor (client)")):
            ax.set(xscale="log", yscale="log", xlabel=xlabel, title=title)
            ax.set_xticks(levels, [f"{c:g}" for c in levels])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5)))
            ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.legend(fontsize=8)
    fig.suptitle(result["summary"].split(" | ")[0], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="tts-bench", description=__doc__)
    p.add_argument("--address", help="HOST:PORT of a running server (default: start tts-server "
                                     "for the run)")
    p.add_argument("--model", default="synthetic-tiny", help="model of a self-started server")
    p.add_argument("--engine", default="auto", help="engine of a self-started server")
    p.add_argument("--max-streams", type=int,
                   help="of a self-started server (default: max concurrency, or the server's own "
                        "default with --rps)")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds a self-started server may take to load")
    p.add_argument("--concurrency", default="1,2,4",
                   help="closed-loop levels, comma-separated, e.g. 1,4,16,64 ('' for none)")
    p.add_argument("--rps", default="", help="open-loop Poisson arrival rates (requests/s), e.g. 5,10,20")
    p.add_argument("--channels", type=int, default=64, help="gRPC channels of the open-loop generator")
    p.add_argument("--connections", type=int, default=0,
                   help="gRPC closed loop: the level's clients share this many connections (e.g. 1: "
                        "every call on one connection, as a client with one channel; with --processes, "
                        "at least one per load process; default 0: a connection per client)")
    p.add_argument("--processes", type=int, default=1,
                   help="load processes for each closed-loop level, gRPC or HTTP (each its own event "
                        "loop and a share of the streams; for hundreds of streams, so that the client's own "
                        "Python does not delay sends and reads)")
    p.add_argument("--transport", choices=["grpc", "http", "both"], default="grpc",
                   help="gRPC Synthesize, the OpenAI-compatible HTTP API (streamed PCM), or both in "
                        "the same run against the same server")
    p.add_argument("--http-url", help="the HTTP API of a running server (default: --address's "
                                      "host, port 8000)")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="builtin",
                   help="built-in texts: builtin (ten languages, short to paragraph) or english "
                        "(24 voice-agent replies of 5-40 words)")
    p.add_argument("--fixed-duration", action="store_true",
                   help="every request runs to --max-duration (streams of one set length)")
    p.add_argument("--requests", type=int, default=8, help="requests per concurrency level")
    p.add_argument("--warmup", type=int, default=2, help="untimed requests before the sweep")
    p.add_argument("--seed", type=int, default=1234, help="workload order and sampling seeds")
    p.add_argument("--text-file", help="one text per line (or LANGUAGE<TAB>TEXT) instead of the "
                                       "built-ins (default: --workload)")
    p.add_argument("--max-duration", type=float, default=20.0, help="cap on each request's audio (s)")
    p.add_argument("--voice", default="", help="voice for every request (default: the server's default)")
    p.add_argument("--preroll-ms", type=float, default=200.0,
                   help="player start delay after the first chunk (underruns at 0 ms are also reported)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request deadline (s)")
    p.add_argument("--baseline", choices=["none", "qwen-tts"], default="none",
                   help="also time qwen-tts generate on the same requests")
    p.add_argument("--baseline-concurrency", default="1", help="static batch sizes of the baseline")
    p.add_argument("--baseline-requests", type=int, default=0, help="first N requests (default: all)")
    p.add_argument("--baseline-model", help="model for the baseline (default: the server's --model)")
    p.add_argument("--json", help="write every record and the aggregates to this file "
                                  "(default: none)")
    p.add_argument("--plot", help="write TTFC and RTF vs concurrency to this PNG (needs "
                                  "matplotlib; default: none)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress line per finished request (default: progress shown)")
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    utterances = load_text_file(a.text_file) if a.text_file else WORKLOADS[a.workload]
    items = schedule(utterances, a.requests, a.seed, a.max_duration, fixed=a.fixed_duration)
    levels = [int(x) for x in a.concurrency.split(",") if x]
    if not levels and not a.rps:
        print("error: give --concurrency levels or --rps rates", file=sys.stderr)
        return 2
    for path in (a.json, a.plot):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    load_start = os.getloadavg()[0]
    max_streams = a.max_streams or (0 if a.rps else max(levels))
    server = None if a.address else ServerProcess(a.model, a.engine, max_streams, ("--metrics-port", "-1"),
                                                  max_queue=a.requests if a.rps else 0)
    try:
        info, voice, records = asyncio.run(run_grpc(a.address or server.address, items, a, server))
        if server:
            server.stop()  # frees the device and cores before the baseline runs
        if a.baseline == "qwen-tts":
            records += run_baseline(items, a, info, voice)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, grpc.aio.AioRpcError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if server:
            server.stop()
    result = report(a, info, voice, items, records, load_start)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    if a.plot:
        plot(result, a.plot)
    return 0 if any(r.status == "OK" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
