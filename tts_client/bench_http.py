"""tts-bench's HTTP transport: the same closed- and open-loop sweeps as gRPC, through the server's
OpenAI-compatible API (POST /v1/audio/speech, 16-bit PCM streamed in a chunked body), with the
same records: TTFC = send -> first body bytes, each body read is one arrival."""

from __future__ import annotations

import asyncio
import time

from .stats import RequestRecord
from .workloads import open_loop, poisson_arrivals

STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 413: "RESOURCE_EXHAUSTED",
          429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE"}


async def served_model(session, base_url: str) -> str:
    async with session.get(f"{base_url}/v1/models") as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def run_one(session, base_url: str, model: str, item, level: float, voice: str,
                  frame_rate: float, timeout: float, preroll_s: float, t_level: float,
                  system: str = "http", scheduled_s: float | None = None) -> RequestRecord:
    import aiohttp

    u = item.utterance
    rec = RequestRecord(system, level, item.index, u.text_id, u.language, len(u.text),
                        item.max_duration_s(frame_rate))
    tag = f"r{level:g}" if system.endswith("-rps") else f"c{level}"
    body = {"model": model, "input": u.text, "voice": voice, "language": u.language,
            "seed": item.seed, "max_duration_s": rec.max_duration_s, "response_format": "pcm"}
    arrivals, durations = [], []
    t0 = time.perf_counter()
    if scheduled_s is not None:
        rec.lag_ms = (t0 - t_level - scheduled_s) * 1000
    try:
        async with session.post(f"{base_url}/v1/audio/speech", json=body,
                                headers={"x-request-id": f"bench-http-{tag}-{item.index}"},
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                rec.status = STATUS.get(resp.status, f"HTTP_{resp.status}")
                rec.error = (await resp.text())[:500]
            else:
                rate = int(resp.headers.get("x-sample-rate", "24000"))
                async for data in resp.content.iter_any():
                    arrivals.append(time.perf_counter() - t0)
                    durations.append(len(data) / 2 / rate)
    except asyncio.TimeoutError:
        rec.status, rec.error = "DEADLINE_EXCEEDED", f"no complete response within {timeout:g} s"
    except aiohttp.ClientError as e:  # a body cut mid-stream, a refused connection
        rec.status, rec.error = "TRANSPORT_ERROR", repr(e)
    t1 = time.perf_counter()
    rec.start_s, rec.end_s = t0 - t_level, t1 - t_level
    rec.add_trace(arrivals, durations, t1 - t0, preroll_s)
    rec.num_frames = round(rec.audio_s * frame_rate)
    if rec.status == "OK":
        rec.finish_reason = "max_length" if rec.num_frames >= round(rec.max_duration_s * frame_rate) else "eos"
    return rec


async def _open_connections(session, base_url: str, n: int) -> None:
    """Open the level's `n` keep-alive connections before it starts (one GET /v1/models on each),
    as the gRPC closed loop's channels are connected before it starts: a burst then times the
    server, not n TCP and HTTP connection set-ups in this load process (one process opening 256
    during a burst was the bound of its first audio, BENCHMARKS.md session 30). Clients of a
    speech API keep their connections open between requests."""
    async def one():
        async with session.get(f"{base_url}/v1/models") as resp:
            await resp.read()

    await asyncio.gather(*(one() for _ in range(n)))


def _session(limit: int):
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, force_close=False))


async def run_level(base_url: str, model: str, items, level: int, a, voice: str,
                    frame_rate: float, progress, num_clients: int | None = None,
                    start_at: float | None = None) -> list[RequestRecord]:
    """Closed loop: `level` clients (or `num_clients`: this load process's share of them), each
    sending its next request when the last one ends; start_at: a unix time to start at (load
    processes start together)."""
    lanes = min(num_clients or level, len(items))
    async with _session(lanes) as session:
        await _open_connections(session, base_url, lanes)
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        pending, records, t_level = iter(items), [], time.perf_counter()

        async def worker():
            for item in pending:
                rec = await run_one(session, base_url, model, item, level, voice, frame_rate,
                                    a.timeout, a.preroll_ms / 1000, t_level)
                records.append(rec)
                if progress:
                    progress.update(rec.status == "OK")

        await asyncio.gather(*(worker() for _ in range(lanes)))
        return sorted(records, key=lambda r: r.index)


async def run_rate(base_url: str, model: str, items, rps: float, a, voice: str,
                   frame_rate: float, progress) -> list[RequestRecord]:
    """Open loop: Poisson arrivals at `rps` (the same seeded schedule as gRPC's open loop)."""
    arrivals = poisson_arrivals(len(items), rps, a.seed)
    async with _session(0) as session:
        return await open_loop(items, arrivals, lambda i, item, t_start: run_one(
            session, base_url, model, item, rps, voice, frame_rate, a.timeout,
            a.preroll_ms / 1000, t_start, "http-rps", arrivals[i]), progress)
