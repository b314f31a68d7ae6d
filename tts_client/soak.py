"""`tts-soak`: mixed load with random cancels against a loopback server for N minutes (or N
requests), then a report of errors, leaks and latency drift. Exit status 1 on an unexpected
status code, a stream or file descriptor left behind, or memory growth past the bound.

Each client lane loops over scenarios drawn at random:
  complete   read the whole stream (OK)             cancel    hang up at a random chunk
  deadline   a deadline that may expire mid-stream  slow      read with pauses (a slow player)
  invalid    a malformed request (INVALID_ARGUMENT) burst     several requests at once
RESOURCE_EXHAUSTED is an expected answer anywhere (admission control at work) and is counted.
The server's own /metrics supply memory, open descriptors and stream gauges; by default the
soak starts its own `tts-server` (tiny synthetic model) and stops it with SIGTERM at the end,
which must drain and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field

import grpc

from .bench import ServerProcess, free_port
from .client import TTSClient, build_request
from .helpfmt import ArgumentParser
from .stats import percentile

SCENARIOS = {"complete": 45, "cancel": 20, "deadline": 10, "slow": 5, "invalid": 10, "burst": 10}
EXPECTED = {
    "complete": {"OK"}, "cancel": {"OK", "CANCELLED"}, "deadline": {"OK", "DEADLINE_EXCEEDED"},
    "slow": {"OK"}, "invalid": {"INVALID_ARGUMENT"}, "burst": {"OK"},
}
INVALID = [
    dict(text=""), dict(text="x" * 5000), dict(text="hi", voice="nobody"),
    dict(text="hi", sample_rate_hz=5), dict(text="hi", temperature=-1.0),
    dict(text="hi", top_p=2.0), dict(text="bell\x07"), dict(text="hi", request_id="bad id"),
]
TEXTS = ["Hello there.", "The quick brown fox jumps over the lazy dog.",
         "Streaming speech, one chunk at a time.", "Is this thing on?",
         "A slightly longer sentence, so that some streams run for a few seconds."]
SERVER_EXPECTED = {"OK", "CANCELLED", "DEADLINE_EXCEEDED", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}
LOOPBACK = ("127.0.0.1", "localhost", "[::1]", "::1")


@dataclass
class Window:
    index: int
    start_s: float
    end_s: float = 0.0
    requests: int = 0
    codes: Counter = field(default_factory=Counter)
    ttfc_ms: list = field(default_factory=list)
    rtf: list = field(default_factory=list)
    rss_mb: float | None = None
    open_fds: float | None = None
    engine_rss_mb: float | None = None  # the engine process's, where it has one
    engine_open_fds: float | None = None
    active_streams: float | None = None

    def summary(self) -> dict:
        return {"index": self.index, "start_s": round(self.start_s, 1), "end_s": round(self.end_s, 1),
                "requests": self.requests, "codes": dict(self.codes),
                "ttfc_p50_ms": _r(percentile(self.ttfc_ms, 50)),
                "ttfc_p95_ms": _r(percentile(self.ttfc_ms, 95)),
                "rtf_p50": _r(percentile(self.rtf, 50), 3), "rss_mb": _r(self.rss_mb),
                "open_fds": self.open_fds, "engine_rss_mb": _r(self.engine_rss_mb),
                "engine_open_fds": self.engine_open_fds, "active_streams": self.active_streams}


# the engine process's own memory and descriptors (tts-server --engine-process)
ENGINE_RSS, ENGINE_FDS = "tts_engine_process_resident_memory_bytes", "tts_engine_process_open_fds"


def _r(v, nd=1):
    return None if v is None else round(v, nd)


def scrape(url: str) -> dict[str, float]:
    """The samples of a Prometheus text page by name{labels}, plus each labelled name summed
    over its labels under the bare name (tts_active_streams: every engine's, whatever device)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, float] = {}
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name if not s.labels else f"{s.name}{{{','.join(f'{k}={v}' for k, v in sorted(s.labels.items()))}}}"
            out[key] = s.value
            if s.labels:
                sums[s.name] = sums.get(s.name, 0.0) + s.value
    for name, total in sums.items():
        out.setdefault(name, total)
    return out


class Soak:
    def __init__(self, a, address: str, metrics_url: str | None):
        self.a = a
        self.address = address
        self.metrics_url = metrics_url
        self.rng = random.Random(a.seed)
        self.t0 = time.monotonic()
        self.window_s = a.duration_s / a.windows
        self.windows = [Window(0, 0.0)]
        self.unexpected: list[dict] = []
        self.scenarios: Counter = Counter()
        self.issued = 0

    def window(self) -> Window:
        return self.windows[-1]

    def record(self, scenario: str, code: str, detail: str = "", ttfc_ms=None, rtf=None) -> None:
        w = self.window()
        w.requests += 1
        w.codes[code] += 1
        self.scenarios[scenario] += 1
        if ttfc_ms is not None:
            w.ttfc_ms.append(ttfc_ms)
        if rtf is not None:
            w.rtf.append(rtf)
        if code not in EXPECTED[scenario] and code != "RESOURCE_EXHAUSTED":
            self.unexpected.append({"scenario": scenario, "code": code, "detail": detail[:300],
                                    "at_s": round(time.monotonic() - self.t0, 2)})

    async def one(self, client: TTSClient, scenario: str) -> None:
        rng, i = self.rng, self.issued
        self.issued += 1
        if scenario == "invalid":
            kwargs = dict(rng.choice(INVALID))
            req = build_request(kwargs.pop("text"), **kwargs)
        else:
            req = build_request(rng.choice(TEXTS), seed=i, request_id=f"soak-{i}",
                                max_duration_s=round(rng.uniform(0.16, self.a.max_audio_s), 2))
        timeout = rng.uniform(0.05, 1.5) if scenario == "deadline" else self.a.timeout
        cancel_at = rng.randint(0, 4) if scenario == "cancel" else None
        t0 = time.perf_counter()
        ttfc_ms, audio_s, chunks = None, 0.0, 0
        call = client.stream(req, timeout=timeout)
        try:
            async for msg in call:
                if msg.HasField("audio"):
                    if ttfc_ms is None:
                        ttfc_ms = (time.perf_counter() - t0) * 1000.0
                    audio_s += msg.audio.num_samples / msg.audio.sample_rate_hz
                    chunks += 1
                    if scenario == "slow":
                        await asyncio.sleep(rng.uniform(0.05, 0.3))
                if cancel_at is not None and chunks >= cancel_at:
                    call.cancel()
                    self.record(scenario, "CANCELLED")
                    return
            wall = time.perf_counter() - t0
            rtf = wall / audio_s if scenario == "complete" and audio_s else None
            self.record(scenario, "OK", ttfc_ms=ttfc_ms if scenario == "complete" else None, rtf=rtf)
        except grpc.aio.AioRpcError as e:
            self.record(scenario, e.code().name, e.details() or "")
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # back off, as a client should
                await asyncio.sleep(rng.uniform(0.2, 1.0))

    async def lane(self, client: TTSClient, deadline: float) -> None:
        names, weights = zip(*SCENARIOS.items())
        while time.monotonic() < deadline and self.issued < self.a.max_requests:
            scenario = self.rng.choices(names, weights)[0]
            if scenario == "burst":
                await asyncio.gather(*(self.one(client, "burst") for _ in range(self.rng.randint(2, 6))))
            else:
                await self.one(client, scenario)

    async def sample(self, w: Window) -> None:
        if not self.metrics_url:
            return
        try:
            m = await asyncio.to_thread(scrape, self.metrics_url)
        except OSError as e:
            self.unexpected.append({"scenario": "metrics", "code": "SCRAPE_FAILED", "detail": str(e)})
            return
        w.rss_mb = m.get("process_resident_memory_bytes", 0) / 2**20
        w.open_fds = m.get("process_open_fds")
        if ENGINE_RSS in m:
            w.engine_rss_mb = m[ENGINE_RSS] / 2**20
            w.engine_open_fds = m.get(ENGINE_FDS)
        w.active_streams = m.get("tts_active_streams")

    async def close_window(self) -> Window:
        w = self.window()
        w.end_s = time.monotonic() - self.t0
        await self.sample(w)
        print(json.dumps(w.summary()), flush=True)
        return w

    async def ticker(self) -> None:
        """Closes every window but the last (run() closes that once the lanes are done)."""
        while len(self.windows) < self.a.windows:
            await asyncio.sleep(max(0.0, self.t0 + len(self.windows) * self.window_s - time.monotonic()))
            w = await self.close_window()
            self.windows.append(Window(len(self.windows), w.end_s))

    async def drained(self, timeout: float = 60.0) -> dict:
        """Server gauges once the load has stopped: every stream gone, nothing queued."""
        last = {}
        end = time.monotonic() + timeout
        while self.metrics_url and time.monotonic() < end:
            last = await asyncio.to_thread(scrape, self.metrics_url)
            if not last.get("tts_active_streams") and not last.get("tts_queued_streams"):
                break
            await asyncio.sleep(0.2)
        return last

    async def run(self) -> dict:
        a = self.a
        deadline = self.t0 + a.duration_s
        client = TTSClient(self.address, channels=max(1, a.concurrency // 4))  # a connection per 4 lanes
        ticker = asyncio.ensure_future(self.ticker())
        await asyncio.gather(*(self.lane(client, deadline) for _ in range(a.concurrency)))
        ticker.cancel()
        await self.close_window()
        await client.close()
        final = await self.drained()
        return self.report(final)

    def report(self, final: dict) -> dict:
        a, ws = self.a, self.windows
        first = next((w for w in ws if w.rss_mb is not None), None)
        codes = Counter()
        for w in ws:
            codes.update(w.codes)
        leaks = {}
        if final:
            leaks["streams_left"] = final.get("tts_active_streams", 0) + final.get("tts_queued_streams", 0)
            if first is not None:
                leaks["rss_growth_mb"] = round(final["process_resident_memory_bytes"] / 2**20 - first.rss_mb, 1)
                leaks["open_fds_growth"] = final.get("process_open_fds", 0) - (first.open_fds or 0)
            if first is not None and first.engine_rss_mb is not None and ENGINE_RSS in final:
                leaks["engine_rss_growth_mb"] = round(final[ENGINE_RSS] / 2**20 - first.engine_rss_mb, 1)
                leaks["engine_open_fds_growth"] = final.get(ENGINE_FDS, 0) - (first.engine_open_fds or 0)
        ttfc_first = percentile(ws[0].ttfc_ms, 50)
        ttfc_last = percentile(ws[-1].ttfc_ms, 50)
        problems = []
        if self.unexpected:
            problems.append(f"{len(self.unexpected)} unexpected status codes")
        if leaks.get("streams_left"):
            problems.append(f"{leaks['streams_left']:.0f} streams still held after the load stopped")
        if leaks.get("open_fds_growth", 0) > a.max_fd_growth:
            problems.append(f"open file descriptors grew by {leaks['open_fds_growth']:.0f}")
        if leaks.get("rss_growth_mb", 0) > a.max_rss_growth_mb:
            problems.append(f"server memory grew {leaks['rss_growth_mb']} MB (bound {a.max_rss_growth_mb})")
        if leaks.get("engine_open_fds_growth", 0) > a.max_fd_growth:
            problems.append(f"the engine process's descriptors grew by {leaks['engine_open_fds_growth']:.0f}")
        if leaks.get("engine_rss_growth_mb", 0) > a.max_rss_growth_mb:
            problems.append(f"the engine process's memory grew {leaks['engine_rss_growth_mb']} MB "
                            f"(bound {a.max_rss_growth_mb})")
        if not final and self.metrics_url:
            problems.append("no metrics after the load")
        server_codes = {k.split("code=")[1].rstrip("}"): v for k, v in final.items()
                        if k.startswith("tts_requests_total{")}
        odd = {c: n for c, n in server_codes.items() if c not in SERVER_EXPECTED and n}
        if odd:
            problems.append(f"the server counted unexpected status codes {odd}")
        return {
            "address": self.address, "duration_s": round(time.monotonic() - self.t0, 1),
            "concurrency": a.concurrency, "requests": sum(codes.values()),
            "scenarios": dict(self.scenarios), "codes": dict(codes),
            "unexpected": self.unexpected[:50], "num_unexpected": len(self.unexpected),
            "leaks": leaks,
            "latency_drift": {"ttfc_p50_first_ms": _r(ttfc_first), "ttfc_p50_last_ms": _r(ttfc_last),
                              "ratio": _r(ttfc_last / ttfc_first, 2) if ttfc_first and ttfc_last else None},
            "windows": [w.summary() for w in ws],
            "server_codes": server_codes,
            "problems": problems, "ok": not problems,
        }


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="tts-soak", description=__doc__)
    p.add_argument("--address", help="HOST:PORT of a running loopback server (needs --metrics-url; "
                                     "default: start tts-server for the run)")
    p.add_argument("--metrics-url", help="the server's /metrics URL, with --address (default: the "
                                         "self-started server's)")
    p.add_argument("--model", default="synthetic-tiny", help="model of a self-started server")
    p.add_argument("--engine", default="auto", help="engine of a self-started server")
    p.add_argument("--max-streams", type=int, default=4, help="of a self-started server")
    p.add_argument("--max-queue", type=int, default=4, help="of a self-started server")
    p.add_argument("--engine-process", action="store_true",
                   help="a self-started server runs its engine in a process of its own (as on a GPU)")
    p.add_argument("--minutes", type=float, default=10.0, help="how long the load runs")
    p.add_argument("--max-requests", type=int, default=1_000_000, help="stop after this many")
    p.add_argument("--windows", type=int, default=10, help="report intervals (latency drift)")
    p.add_argument("--concurrency", type=int, default=6, help="client lanes")
    p.add_argument("--max-audio-s", type=float, default=2.4, help="longest request's audio")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline of non-deadline requests")
    p.add_argument("--max-rss-growth-mb", type=float, default=150.0,
                   help="server memory growth (after warm-up) that fails the soak")
    p.add_argument("--max-fd-growth", type=int, default=8,
                   help="growth in the server's open descriptors that fails the soak")
    p.add_argument("--seed", type=int, default=1, help="seed of the request mix")
    p.add_argument("--json", help="write the report here (default: only printed)")
    return p


def parse_args(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    a.duration_s = a.minutes * 60.0
    if a.address and a.address.rsplit(":", 1)[0] not in LOOPBACK:
        p.error("the soak runs against loopback servers only")
    if a.address and not a.metrics_url:
        p.error("--address needs --metrics-url (leak checks read the server's metrics)")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    server = None
    if a.address:
        address, metrics_url = a.address, a.metrics_url
    else:
        mport = free_port()
        server = ServerProcess(a.model, a.engine, a.max_streams,
                               ("--metrics-port", str(mport), "--max-queue-wait-s", "10")
                               + (("--engine-process",) if a.engine_process else ()),
                               max_queue=a.max_queue)
        address, metrics_url = server.address, f"http://127.0.0.1:{mport}/metrics"
    try:
        if server:
            asyncio.run(server.wait_serving(600))
        print(f"soak: {a.minutes:g} min, {a.concurrency} lanes against {address}", flush=True)
        result = asyncio.run(Soak(a, address, metrics_url).run())
    finally:
        exit_code = None
        if server:
            server.stop()
            exit_code = server.proc.returncode
    if server:
        result["server_exit_code"] = exit_code
        if exit_code != 0:
            result["problems"].append(f"server exited {exit_code} after SIGTERM (expected 0)")
            result["ok"] = False
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps({k: result[k] for k in ("requests", "scenarios", "codes", "num_unexpected",
                                             "leaks", "latency_drift", "problems", "ok")}, indent=1))
    print("SOAK " + ("PASSED" if result["ok"] else "FAILED: " + "; ".join(result["problems"])))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
