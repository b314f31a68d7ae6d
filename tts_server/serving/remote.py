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
import itertools
import logging
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

import numpy as np
from prometheus_client import ProcessCollector

from ..api import (AudioChunk, EngineFailure, FinishReason, ModelInfo, Overloaded, ShuttingDown,
                   StreamEnd, Unsupported)
from ..config import ServerConfig
from ..memory_plan import StartupError
from ..metrics import Metrics
from .ipc import Outbox, receive
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
        self._outbox.put(("text", self.sid, event))

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


class RemoteWorker:
    """The Worker interface, served by an engine process."""

    def __init__(self, proc: subprocess.Popen, conn: Connection, info: ModelInfo, facts: dict):
        self.proc = proc
        self.conn = conn
        self.info = info
        self.label = ",".join(facts["labels"])
        self.max_streams = facts["max_streams"]
        self.max_outstanding = facts["max_outstanding"]
        self.supports_incremental = facts["incremental"]
        self.engine_name = facts["engine"]
        self.metrics = Metrics(engine_series=False)
        self._series = _EngineSeries()
        self.metrics.registry.register(self._series)
        # the engine process's memory, descriptors and CPU: tts_engine_process_resident_memory_bytes, ...
        ProcessCollector(namespace="tts_engine", pid=lambda: proc.pid, registry=self.metrics.registry)
        self.failure: EngineFailure | None = None
        self.watchdog_tick = None  # the engine process runs its own watchdog and backstop
        self._fatal_listeners: list = []
        self._lock = threading.Lock()
        self._handles: dict[int, RemoteHandle] = {}
        self._sids = itertools.count(1)
        self._stopping = False
        self._outbox = Outbox(conn, "tts-server-pipe-out")

    # ---- start-up -----------------------------------------------------------------------
    @staticmethod
    def spawn(config: ServerConfig) -> tuple[subprocess.Popen, Connection]:
        """Starts the engine process. Call it from the main thread: the engine process is
        killed when the thread that started it ends (Linux parent-death signal)."""
        ours, theirs = socket.socketpair()
        proc = subprocess.Popen([sys.executable, "-m", "tts_server.serving.engine_process",
                                 str(theirs.fileno())], pass_fds=(theirs.fileno(),))
        theirs.close()
        conn = Connection(ours.detach())
        try:
            conn.send(config)
        except OSError:  # it died at once: connect() reports its exit status
            pass
        return proc, conn

    @classmethod
    def connect(cls, proc: subprocess.Popen, conn: Connection) -> "RemoteWorker":
        """Waits until the spawned engine process has loaded the model and built its engines
        (blocking); its start-up mistake becomes this process's StartupError (one line)."""
        try:
            first = conn.recv()
        except (EOFError, OSError):
            code = proc.wait()
            raise StartupError(f"the engine process exited (status {code}) before it was "
                               "ready; its log is above") from None
        kind, *rest = first[0]
        if kind == "error":
            proc.wait()
            raise StartupError(rest[0])
        info, facts = rest
        worker = cls(proc, conn, info, facts)
        worker._on_batch(first[1:])  # (whatever came with "ready": metrics)
        log.info("engine process %d: %s, %d slots", facts["pid"], worker.label, worker.max_streams)
        return worker

    def start(self) -> None:
        receive(self.conn, self._on_batch, self._on_eof, "tts-server-pipe-in")

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
            if len(self._handles) >= self.max_outstanding:
                raise Overloaded(f"all {self.max_streams} synthesis streams are busy and "
                                 f"{self.max_outstanding - self.max_streams} requests are queued")
            handle = RemoteHandle(request, loop, next(self._sids), self._outbox)
            self._handles[handle.sid] = handle
        self._outbox.put(("submit", handle.sid, request, handle.submitted_at))
        return handle

    def stop(self, timeout: float | None = None) -> None:
        """The engine process ends its streams and exits (killed after `timeout`)."""
        with self._lock:
            self._stopping = True
        self._outbox.put(("stop",))
        self._outbox.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("engine process %d did not stop in %.0f s; killed", self.proc.pid, timeout)
            self.proc.kill()
            self.proc.wait()

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
            elif kind == "fail":
                self._deliver_all(events)
                events = []
                self.fail(EngineFailure(item[1]))
        self._deliver_all(events)

    def _deliver_all(self, events: list) -> None:
        """One event-loop callback per loop for a batch of (handle, event)."""
        by_loop: dict = {}
        for handle, event in events:
            by_loop.setdefault(handle._loop, []).append((handle, event))
        for loop, pairs in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, pairs)
            except RuntimeError:  # that loop has closed
                pass

    def _on_eof(self) -> None:
        if self._stopping:
            return
        code = self.proc.poll()
        deadline = time.monotonic() + 2.0
        while code is None and time.monotonic() < deadline:
            time.sleep(0.05)
            code = self.proc.poll()
        self.fail(EngineFailure(f"the engine process ended (status {code})"))


def _deliver(pairs: list) -> None:
    for handle, event in pairs:
        handle.deliver(event)
