"""Prometheus metrics (prometheus_client), one registry per server process.

Served on `--metrics-port` at /metrics. Names follow Prometheus conventions: seconds for time,
`_total` for counters; frames/s is `rate(tts_frames_total[1m])`. What an engine does carries a
`device` label (one engine per device with `--devices`); what a call does is server-wide.
"""

from __future__ import annotations

import logging

from dataclasses import dataclass

import socket
import threading
from typing import Callable
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               make_wsgi_app)
from prometheus_client.exposition import ThreadingWSGIServer

log = logging.getLogger(__name__)

TTFC_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
RTF_BUCKETS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.85, 1.0, 1.25, 1.5, 2.0, 4.0)
STEP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # scrapes and probes every few seconds: not logged
        pass


@dataclass(frozen=True)
class EngineMetrics:
    """One engine's series (the families' children for its `device` label)."""

    active_streams: Gauge
    queued_streams: Gauge
    paused_streams: Gauge
    stream_slots: Gauge
    engine_healthy: Gauge
    queue_wait: Histogram
    step: Histogram
    frames: Counter


ENGINE_FAMILIES = ("tts_active_streams", "tts_queued_streams", "tts_paused_streams",
                   "tts_stream_slots", "tts_engine_healthy", "tts_queue_wait_seconds",
                   "tts_engine_step_seconds", "tts_frames")


CALL_FAMILIES = ("tts_requests", "tts_time_to_first_chunk_seconds", "tts_real_time_factor",
                 "tts_audio_seconds")


def merge_families(sources: list[list]) -> list:
    """Metric families of the same series from several processes as one: counters, histogram
    buckets, sums and counts add up; a `_created` time is the earliest."""
    from prometheus_client.metrics_core import Metric

    merged: dict[str, Metric] = {}
    values: dict[str, dict] = {}
    for families in sources:
        for fam in families:
            if fam.name not in merged:
                merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                values[fam.name] = {}
            series = values[fam.name]
            for smp in fam.samples:
                key = (smp.name, tuple(sorted(smp.labels.items())))
                if key not in series:
                    series[key] = smp.value
                elif smp.name.endswith("_created"):
                    series[key] = min(series[key], smp.value)
                else:
                    series[key] += smp.value
    for name, fam in merged.items():
        for (sname, labels), value in values[name].items():
            fam.add_sample(sname, dict(labels), value)
    return list(merged.values())


class Metrics:
    """`engine_series=False`: the calls' series only; the engines' come from an engine process
    (serving/remote.py registers a collector that serves its latest snapshot). `calls_registry`:
    where the calls' series live when it is not the served registry (several RPC processes: the
    served one then merges every process's, serving/remote.py)."""

    def __init__(self, engine_series: bool = True, calls_registry: CollectorRegistry | None = None):
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_open_fds, CPU
        self._http = None
        self.calls_registry = calls_registry or r
        self._calls(self.calls_registry)
        if engine_series:
            self._engines(r)

    def engine_snapshot(self) -> list:
        """The engines' metric families as they are now (picklable; for the server process)."""
        return [m for m in self.registry.collect() if m.name in ENGINE_FAMILIES]

    def calls_snapshot(self) -> list:
        """The calls' metric families as they are now (picklable; from an extra RPC process)."""
        return [m for m in self.calls_registry.collect() if m.name in CALL_FAMILIES]

    def _engines(self, r: CollectorRegistry) -> None:
        dev = ("device",)
        self.active_streams = Gauge("tts_active_streams", "Streams holding an engine slot", dev,
                                    registry=r)
        self.queued_streams = Gauge("tts_queued_streams", "Streams waiting for an engine slot", dev,
                                    registry=r)
        self.paused_streams = Gauge("tts_paused_streams",
                                    "Active streams paused because their client is not reading", dev,
                                    registry=r)
        self.stream_slots = Gauge("tts_stream_slots", "Engine slots (concurrent streams) this engine "
                                  "serves; 0 once it has failed", dev, registry=r)
        self.engine_healthy = Gauge("tts_engine_healthy", "1 while the decode engine works, 0 after "
                                    "a hang or device fault", dev, registry=r)
        self.queue_wait = Histogram("tts_queue_wait_seconds", "Submission to engine slot", dev,
                                    buckets=STEP_BUCKETS, registry=r)
        self.step = Histogram("tts_engine_step_seconds",
                              "One engine iteration: a decode step for all active streams plus "
                              "their chunk decodes", dev, buckets=STEP_BUCKETS, registry=r)
        self.frames = Counter("tts_frames", "Codec frames generated (80 ms of audio each)", dev,
                              registry=r)

    def _calls(self, r: CollectorRegistry) -> None:
        self.requests = Counter("tts_requests", "Finished Synthesize calls by gRPC status code",
                                ["code"], registry=r)
        self.ttfc = Histogram("tts_time_to_first_chunk_seconds",
                              "Request arrival to first audio chunk written", buckets=TTFC_BUCKETS,
                              registry=r)
        self.rtf = Histogram("tts_real_time_factor", "Wall time / audio time of completed streams",
                             buckets=RTF_BUCKETS, registry=r)
        self.audio_seconds = Counter("tts_audio_seconds", "Audio seconds streamed to clients",
                                     registry=r)

    def engine(self, device: str) -> EngineMetrics:
        """The series of the engine on `device` (its label); it starts healthy."""
        m = EngineMetrics(*(getattr(self, f).labels(device=device) for f in (
            "active_streams", "queued_streams", "paused_streams", "stream_slots", "engine_healthy",
            "queue_wait", "step", "frames")))
        m.engine_healthy.set(1)
        return m

    def serve(self, host: str, port: int, ready: Callable[[], bool] = lambda: True) -> int:
        """Start the HTTP endpoint in a daemon thread; returns the bound port. /ready answers 200
        while ready() (the server's gRPC health is SERVING), else 503 (draining, failed), for
        load balancers that check over HTTP; every other path serves the metrics."""
        metrics_app = make_wsgi_app(self.registry)

        def app(environ, start_response):
            if environ.get("PATH_INFO") != "/ready":
                return metrics_app(environ, start_response)
            is_ready = ready()
            start_response("200 OK" if is_ready else "503 Service Unavailable",
                           [("Content-Type", "text/plain; charset=utf-8")])
            return [b"SERVING\n" if is_ready else b"NOT_SERVING\n"]

        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]
        server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
        self._http = make_server(sockaddr[0], port, app, server_class, handler_class=_QuietHandler)
        threading.Thread(target=self._http.serve_forever, name="tts-metrics", daemon=True).start()
        return self._http.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
