"""The engine process (`tts-server --engine-process`): the model, the engines and their threads
in a process of their own, so that the engine thread's Python and the gRPC/HTTP event loop's
(call set-up, chunk writes) no longer take turns on one GIL.

Started by serving/remote.py as `python -m tts_server.serving.engine_process FD [FD ...]`: its
ends of Unix socket pairs, the server process's first, then one per extra RPC process
(--rpc-processes). The server sends the ServerConfig on the first; every RPC process sends batches of
("submit", sid, request, submitted_at) / ("cancel", sid) / ("text", sid, TextEvent) /
("sent", sid, samples) / ("calls", families) (an extra RPC process's call metrics) / ("stop",)
(the server process's only); this process answers ("ready", info, facts) or ("error", line) once
on each, then batches of ("a", sid, float32 bytes, sample_offset, num_frames,
sequence_number, timings) (an AudioChunk) / ("ev", sid, event) (any other event) /
("fail", message), and on the first ("metrics", families) / ("calls", index, families). It
exits when the server's end of the first pipe closes, or with the server (Linux parent-death
signal); an extra RPC process's pipe closing cancels that process's streams.
"""

from __future__ import annotations

import faulthandler
import importlib
import logging
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection

import numpy as np

from .. import aio
from ..api import AudioChunk, FinishReason, StreamEnd
from ..memory_plan import StartupError
from .ipc import Outbox, die_with_parent, receive_many
from .streams import StreamHandle

log = logging.getLogger("tts_server")

METRICS_PERIOD_S = 0.5


class PipeHandle(StreamHandle):
    """The engine's side of a stream whose caller is in the server process: events go to the
    pipe (the loop argument of a StreamHandle is unused)."""

    def __init__(self, request, sid: int, outbox: Outbox, table: dict):
        super().__init__(request, None, None)
        self.sid = sid
        self._outbox = outbox
        self._table = table

    def post(self, event) -> None:
        if not self.account(event):
            return
        if isinstance(event, AudioChunk) and event.samples.dtype == np.float32:
            # as plain values: a step's few hundred chunks pickle in a fraction of the time; a
            # stream's first audio written at once (ipc.Outbox: urgent)
            self._outbox.put(("a", self.sid, event.samples.tobytes(), event.sample_offset,
                              event.num_frames, event.sequence_number, event.timings),
                             urgent=event.sequence_number == 0)
            return
        if isinstance(event, StreamEnd):
            self._table.pop(self.sid, None)
            if event.error is not None:
                event = _picklable_end(event)
        self._outbox.put(("ev", self.sid, event))


def _picklable_end(end: StreamEnd) -> StreamEnd:
    """The end as sent: an error that does not survive pickling becomes a RuntimeError that says
    what it was."""
    import pickle

    try:
        pickle.loads(pickle.dumps(end.error))
        return end
    except Exception:  # noqa: BLE001 - any pickling failure
        return StreamEnd(end.finish_reason, end.num_frames, end.num_samples,
                         RuntimeError(f"{type(end.error).__name__}: {end.error}"))


class EngineProcess:
    """Dispatches one RPC process's messages to the Worker (or pool) and its events back.
    Pipe 0 is the server process's (the configuration, the engines' metrics, "stop"); the others
    are extra RPC processes' (--rpc-processes), whose call metrics go on to pipe 0."""

    def __init__(self, index: int, worker, outbox: Outbox, primary: Outbox, done: threading.Event):
        self.index = index
        self.worker = worker
        self.outbox = outbox
        self.primary = primary
        self.handles: dict[int, PipeHandle] = {}
        self.done = done

    def on_batch(self, items: list) -> None:
        for item in items:
            kind, args = item[0], item[1:]
            if kind == "submit":
                self._submit(*args)
            elif kind == "stop":
                self.done.set()
                return
            elif kind == "calls":
                self.primary.put(("calls", self.index, args[0]))
            else:
                handle = self.handles.get(args[0])
                if handle is None:  # already ended here: nothing to do
                    continue
                if kind == "cancel":
                    handle.cancel()
                elif kind == "text":
                    handle.push_text(args[1])
                elif kind == "sent":
                    handle.mark_sent(args[1])

    def _submit(self, sid: int, request, submitted_at: float) -> None:
        handle = PipeHandle(request, sid, self.outbox, self.handles)  # enqueue sets its wake
        handle.submitted_at = submitted_at  # the server's clock (CLOCK_MONOTONIC is system-wide)
        self.handles[sid] = handle
        try:
            self.worker.enqueue(handle)
        except Exception as e:  # noqa: BLE001 - refused here (the server checked first; a race)
            handle.post(StreamEnd(FinishReason.ERROR, 0, 0, e))

    def on_eof(self) -> None:
        """The server process has gone (or stopped us): stop. An extra RPC process has gone: its
        streams are cancelled (the engine ends them at its next step)."""
        if self.index == 0:
            self.done.set()
            return
        for handle in list(self.handles.values()):
            handle.cancel()

    def send_metrics(self) -> None:
        while not self.done.wait(METRICS_PERIOD_S):
            self.outbox.put(("metrics", self.worker.metrics.engine_snapshot()))


def main() -> None:
    die_with_parent()
    # Ctrl-C reaches the terminal's whole process group, and a service manager may signal every
    # process of the service: the server drains on them; this process ends when told (or with it)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conns = [Connection(int(fd)) for fd in sys.argv[1:]]  # pipe 0: the server process's
    conn = conns[0]
    config = conn.recv()
    from ..logs import quiet_imports, setup_logging

    setup_logging(config.log_level, config.log_format)
    try:
        if factory := os.environ.get("TTS_ENGINE_FACTORY"):  # benchmarks of the RPC layer only
            module, _, name = factory.partition(":")
            app = getattr(importlib.import_module(module), name)(config)
            log.warning("TTS_ENGINE_FACTORY=%s: not a real engine", factory)
        else:
            with quiet_imports():
                import qwen_tts  # noqa: F401
            from ..app import build_app

            app = build_app(config)
    except StartupError as e:
        conn.send([("error", str(e))])
        raise SystemExit(2) from None
    except Exception as e:  # noqa: BLE001 - said in one line; the traceback in this log
        log.exception("engine process: start-up failed")
        conn.send([("error", f"{type(e).__name__}: {e}")])
        raise SystemExit(2) from None
    aio.freeze_start_up_objects()  # as the in-process server does
    worker = app.worker
    if config.watchdog_s > 0:
        # the backstop for a hang the Python watchdog cannot act on: the server sees the pipe end
        worker.watchdog_tick = lambda: faulthandler.dump_traceback_later(
            config.watchdog_s + 30.0, exit=True)
    # one sending thread and one receiving thread for all the pipes (an RPC process each), not
    # two per pipe beside the engine thread (Outbox's `shared`, BENCHMARKS.md session 27)
    outboxes = [Outbox(conns[0], "tts-engine-pipe-out")]
    outboxes += [Outbox(c, "tts-engine-pipe-out", shared=outboxes[0]) for c in conns[1:]]
    outbox, done = outboxes[0], threading.Event()
    procs = [EngineProcess(i, worker, o, outbox, done) for i, o in enumerate(outboxes)]
    worker.add_fatal_listener(lambda failure: [o.put(("fail", str(failure))) for o in outboxes])
    facts = {"max_streams": worker.max_streams,
             "max_outstanding": getattr(worker, "max_outstanding", None) or sum(
                 w.max_outstanding for w in worker.workers),
             "incremental": all(w.texts.supported for w in getattr(worker, "workers", [worker])),
             "engine": app.info.engine, "labels": [w.label for w in getattr(worker, "workers", [worker])],
             "pid": os.getpid()}
    for o in outboxes:
        o.put(("ready", app.info, facts))
    receive_many([(c, p.on_batch, p.on_eof) for c, p in zip(conns, procs)], "tts-engine-pipe-in")
    threading.Thread(target=procs[0].send_metrics, name="tts-engine-metrics", daemon=True).start()
    done.wait()
    # the server stops us after its drain, or has gone: end the streams still here, then leave
    worker.stop(10.0)
    for o in outboxes:
        o.close()
    logging.shutdown()
    os._exit(0)  # an engine thread stuck in a device call must not keep the process


if __name__ == "__main__":
    main()
