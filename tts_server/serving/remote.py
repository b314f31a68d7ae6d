"""The server process's side of `--engine-process`: a RemoteWorker that the rpc and HTTP layers
use exactly as they use a Worker (submit, metrics, failure, fatal listeners, stop), backed by the
engine process (serving/engine_process.py) over a socket pair.

Admission is decided here, at once and exactly (this process is the engine's only caller, so it
knows every stream not yet ended): Overloaded, ShuttingDown, EngineFailure and Unsupported are
raised from submit() as the Worker raises them. Events come back in batches and are handed to
the event loop with one callback per batch. If the engine process ends (a crash, the watchdog's
backstop), every stream ends UNAVAILABLE and the server exits for its supervisor, as for a
failed engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

import numpy as np
from prometheus_client import CollectorRegistry, ProcessCollector

from ..api import (AudioChunk, EngineFailure, FinishReason, ModelInfo, Overloaded, ShuttingDown,
                   StreamEnd, Unsupported)
from ..config import ServerConfig
from ..memory_plan import StartupError
from ..metrics import Metrics, merge_families
from .ipc import LoopReader, Outbox, receive
from .streams import StreamHandle

log = logging.getLogger(__name__)


class RemoteHandle(StreamHandle):
    """A StreamHandle whose engine is in the engine process: cancel, text and reads go down the
    pipe; its events arrive through RemoteWorker."""

    def __init__(self, request, loop, sid: int, outbox: Outbox):
        super().__init__(request, loop, None)
        self.sid = sid
        self._outbox = outbox

    def cancel(self) -> None:
        if not self._cancelled.is_set():
            self._cancelled.set()
            if not self.ended:
                self._outbox.put(("cancel", self.sid))

    def push_text(self, event) -> None:
        self._outbox.put(("text", self.sid, event), urgent=True)

    def mark_sent(self, num_samples: int) -> None:
        self.sent_samples += num_samples
        self._outbox.put(("sent", self.sid, num_samples))

    def deliver(self, event) -> None:
        """On the event loop: an event from the engine."""
        if self.account(event):
            self._queue.put_nowait(event)


class _EngineSeries:
    """A prometheus collector serving the engine process's latest snapshot of its series."""

    def __init__(self):
        self.families: list = []

    def collect(self):
        return list(self.families)


class _MergedCalls:
    """A prometheus collector serving the calls' series of every RPC process as one."""

    def __init__(self, own):
        self.own = own  # this process's calls registry
        self.others: dict[int, list] = {}  # an extra RPC process's latest snapshot, by pipe

    def collect(self):
        return merge_families([list(self.own.collect())] + list(self.others.values()))


class RemoteWorker:
    """The Worker interface, served by an engine process. `proc`: the engine process, in the
    server process that started it (None in an extra RPC process); `exact_admission`: this
    process is the engine's only caller, so it refuses at once what the engine would (with
    several RPC processes the engine decides, and a refusal ends the stream instead)."""

    def __init__(self, proc: subprocess.Popen | None, conn: Connection, info: ModelInfo, facts: dict,
                 exact_admission: bool = True):
        self.proc = proc
        self.conn = conn
        self.info = info
        self.label = ",".join(facts["labels"])
        self.max_streams = facts["max_streams"]
        self.max_outstanding = facts["max_outstanding"]
        self.supports_incremental = facts["incremental"]
        self.engine_name = facts["engine"]
        self.exact_admission = exact_admission
        self.rpc_processes: list[subprocess.Popen] = []  # extra RPC processes (started_serving)
        self.spare_pipes: list[Connection] = []  # the engine's pipes for them, until they start
        self.grace_s = 0.0
        if exact_admission:
            self.metrics = Metrics(engine_series=False)
            self._calls = None
        else:  # the served series add up every RPC process's calls
            self.metrics = Metrics(engine_series=False, calls_registry=CollectorRegistry())
            self._calls = _MergedCalls(self.metrics.calls_registry)
            self.metrics.registry.register(self._calls)
        self._series = _EngineSeries()
        self.metrics.registry.register(self._series)
        if proc is not None:
            # the engine process's memory, descriptors and CPU: tts_engine_process_resident_memory_bytes, ...
            ProcessCollector(namespace="tts_engine", pid=lambda: proc.pid, registry=self.metrics.registry)
        self.failure: EngineFailure | None = None
        self.watchdog_tick = None  # the engine process runs its own watchdog and backstop
        self._fatal_listeners: list = []
        self._lock = threading.Lock()
        self._handles: dict[int, RemoteHandle] = {}
        self._sids = itertools.count(1)
        self._stopping = False
        self._draining = False
        self._outbox = Outbox(conn, "tts-server-pipe-out")
        self._reader: LoopReader | None = None  # start(): the events read on the servers' loop

    # ---- start-up -----------------------------------------------------------------------
    @staticmethod
    def spawn(config: ServerConfig) -> tuple[subprocess.Popen, list[Connection]]:
        """Starts the engine process with a pipe for this process and one for each extra RPC
        process (config.rpc_processes - 1). Call it from the main thread: the engine process is
        killed when the thread that started it ends (Linux parent-death signal)."""
        pairs = [socket.socketpair() for _ in range(max(1, config.rpc_processes))]
        fds = [theirs.fileno() for _, theirs in pairs]
        proc = subprocess.Popen([sys.executable, "-m", "tts_server.serving.engine_process",
                                 *map(str, fds)], pass_fds=fds)
        conns = []
        for ours, theirs in pairs:
            theirs.close()
            conns.append(Connection(ours.detach()))
        try:
            conns[0].send(config)
        except OSError:  # it died at once: connect() reports its exit status
            pass
        return proc, conns

    @classmethod
    def connect(cls, proc: subprocess.Popen | None, conn: Connection,
                exact_admission: bool = True) -> "RemoteWorker":
        """Waits until the engine process has loaded the model and built its engines
        (blocking); its start-up mistake becomes this process's StartupError (one line)."""
        try:
            first = conn.recv()
        except (EOFError, OSError):
            code = proc.wait() if proc is not None else "unknown"
            raise StartupError(f"the engine process exited (status {code}) before it was "
                               "ready; its log is above") from None
        kind, *rest = first[0]
        if kind == "error":
            if proc is not None:
                proc.wait()
            raise StartupError(rest[0])
        info, facts = rest
        worker = cls(proc, conn, info, facts, exact_admission)
        worker._on_batch(first[1:])  # (whatever came with "ready": metrics)
        if proc is not None:
            log.info("engine process %d: %s, %d slots", facts["pid"], worker.label, worker.max_streams)
        return worker

    def start(self) -> None:
        """Read the engine's events: on the running event loop when called from one (the
        servers' loop: no reader thread between the pipe and the handlers), else a thread."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            receive(self.conn, self._on_batch, self._on_eof, "tts-server-pipe-in")
            return
        self._reader = LoopReader(self.conn, loop, self._on_batch, self._on_eof, "tts-server-pipe-eof")

    # ---- the Worker interface ------------------------------------------------------------
    @property
    def num_outstanding(self) -> int:
        """Streams submitted and not yet ended."""
        return len(self._handles)

    def add_fatal_listener(self, fn) -> None:
        self._fatal_listeners.append(fn)

    def submit(self, request, loop: asyncio.AbstractEventLoop) -> RemoteHandle:
        if request.incremental and not self.supports_incremental:
            raise Unsupported(f"the {self.engine_name} engine does not take incremental text; "
                              "use Synthesize, or --engine torch/batched")
        with self._lock:
            if self.failure is not None:
                raise EngineFailure(f"the decode engine failed ({self.failure}); restarting")
            if self._stopping:
                raise ShuttingDown("server is shutting down")
            if self.exact_admission and len(self._handles) >= self.max_outstanding:
                raise Overloaded(f"all {self.max_streams} synthesis streams are busy and "
                                 f"{self.max_outstanding - self.max_streams} requests are queued")
            handle = RemoteHandle(request, loop, next(self._sids), self._outbox)
            self._handles[handle.sid] = handle
        self._outbox.put(("submit", handle.sid, request, handle.submitted_at), urgent=True)
        return handle

    def stop(self, timeout: float | None = None) -> None:
        """In the server process: the extra RPC processes finish their drain, then the engine
        process ends its streams and exits (each killed after `timeout` more). In an extra RPC
        process: its pipe closes (the engine cancels what is left of its streams)."""
        with self._lock:
            self._stopping = True
        for rpc in self.rpc_processes:
            _wait_or_kill(rpc, self.grace_s + (timeout or 0.0), "RPC process")
        if self.proc is not None:
            self._outbox.put(("stop",))
        else:  # an extra RPC process: its last calls' series before it goes
            self._outbox.put(("calls", self.metrics.calls_snapshot()))
        self._outbox.close()
        if self._reader is not None:  # the loop's reader lets go of its copy of the socket
            self._reader.close_soon()
        if self.proc is None:
            self.conn.close()
            return
        _wait_or_kill(self.proc, timeout, "engine process")

    def send(self, item) -> None:
        """One more item down the pipe (an extra RPC process's call metrics)."""
        self._outbox.put(item)

    # ---- extra RPC processes (the server process's worker only) ------------------------------
    def started_serving(self, config: ServerConfig, port: int, http_port: int | None = None) -> None:
        """TTSServer is listening on `port` (gRPC) and `http_port` (the HTTP API, None: off):
        start the extra RPC processes on them, one per spare pipe (they share the ports with
        SO_REUSEPORT; no metrics port of their own: their calls' series come here). One that
        exits on its own fails the server."""
        self.grace_s = config.drain_delay_s + config.grace_period_s
        sub = dataclasses.replace(config, port=port, http_port=-1 if http_port is None else http_port,
                                  metrics_port=-1)
        for conn in self.spare_pipes:
            fd = conn.fileno()
            rpc = subprocess.Popen([sys.executable, "-m", "tts_server.serving.frontend", str(fd)],
                                   pass_fds=(fd,), stdin=subprocess.PIPE)
            rpc.stdin.write(pickle.dumps(sub))
            rpc.stdin.close()
            conn.close()
            self.rpc_processes.append(rpc)
            threading.Thread(target=self._watch_rpc, args=(rpc,), name=f"tts-rpc-{rpc.pid}",
                             daemon=True).start()
        self.spare_pipes = []
        if self.rpc_processes:
            log.info("%d more RPC processes on port %d%s: %s", len(self.rpc_processes), port,
                     "" if http_port is None else f" and HTTP port {http_port}",
                     ", ".join(str(r.pid) for r in self.rpc_processes))

    def begin_drain(self) -> None:
        """The server process drains: so do the extra RPC processes (a Ctrl-C has told them
        already; a SIGTERM to this process alone has not)."""
        self._draining = True  # (new calls are still taken through --drain-delay-s)
        for rpc in self.rpc_processes:
            if rpc.poll() is None:
                rpc.send_signal(signal.SIGTERM)

    def _watch_rpc(self, rpc: subprocess.Popen) -> None:
        code = rpc.wait()
        if not (self._stopping or self._draining):
            self.fail(EngineFailure(f"RPC process {rpc.pid} exited (status {code})"))

    def fail(self, failure: EngineFailure) -> None:
        """End every stream with `failure` and tell the listeners (once)."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = failure
            handles = list(self._handles.values())
            self._handles.clear()
        log.critical("decode engine failed: %s; ending %d streams", failure, len(handles))
        end = StreamEnd(FinishReason.ERROR, 0, 0, failure)
        self._deliver_all([(h, end) for h in handles])
        for fn in self._fatal_listeners:
            try:
                fn(failure)
            except Exception:  # noqa: BLE001
                log.exception("fatal listener failed")

    # ---- the pipe's reader thread ----------------------------------------------------------
    def _on_batch(self, items: list) -> None:
        events = []
        for item in items:
            kind = item[0]
            if kind == "a":
                handle = self._handles.get(item[1])
                if handle is not None:
                    samples = np.frombuffer(item[2], np.float32).copy()
                    events.append((handle, AudioChunk(samples, *item[3:])))
            elif kind == "ev":
                handle = self._handles.get(item[1])
                if handle is not None:
                    events.append((handle, item[2]))
                    if isinstance(item[2], StreamEnd):
                        with self._lock:
                            self._handles.pop(item[1], None)
            elif kind == "metrics":
                self._series.families = item[1]
            elif kind == "calls" and self._calls is not None:
                self._calls.others[item[1]] = item[2]
            elif kind == "fail":
                self._deliver_all(events)
                events = []
                self.fail(EngineFailure(item[1]))
        self._deliver_all(events)

    def _deliver_all(self, events: list) -> None:
        """A batch of (handle, event) to their loops: at once on the loop that reads the pipe,
        one callback per other loop."""
        by_loop: dict = {}
        for handle, event in events:
            by_loop.setdefault(handle._loop, []).append((handle, event))
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        for loop, pairs in by_loop.items():
            if loop is running:
                _deliver(pairs)
                continue
            try:
                loop.call_soon_threadsafe(_deliver, pairs)
            except RuntimeError:  # that loop has closed
                pass

    def _on_eof(self) -> None:
        if self._stopping:
            return
        if self.proc is None:  # an extra RPC process: the engine process is gone
            self.fail(EngineFailure("the engine process ended"))
            return
        code = self.proc.poll()
        deadline = time.monotonic() + 2.0
        while code is None and time.monotonic() < deadline:
            time.sleep(0.05)
            code = self.proc.poll()
        self.fail(EngineFailure(f"the engine process ended (status {code})"))


def _wait_or_kill(proc: subprocess.Popen, timeout: float | None, what: str) -> None:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        log.warning("%s %d did not stop in %.0f s; killed", what, proc.pid, timeout)
        proc.kill()
        proc.wait()


def _deliver(pairs: list) -> None:
    for handle, event in pairs:
        handle.deliver(event)
