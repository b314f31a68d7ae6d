"""A paced stand-in for the engine worker (benchmarks of the RPC layer, never in serving): no
model, every stream gets its 80 ms frames on a real-time clock (the first at once) in chunks of
1, 2, 4, 8 frames, then its end. It has the Worker interface both ways: `submit` (in the server
process) and `enqueue` (in the engine process, for `TTS_ENGINE_FACTORY=tts_server.testing.paced:build`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from ..api import AudioChunk, FinishReason, ModelInfo, Overloaded, StreamEnd
from ..metrics import Metrics
from ..serving.streams import StreamHandle

FRAME_S, SAMPLES_PER_FRAME, CHUNKS = 0.08, 1920, (1, 2, 4, 8)
INFO = ModelInfo(name="paced", model_type="custom_voice", model_size="0b6", is_synthetic=True,
                 warning="PACED TEST ENGINE: no model", engine="paced", device="cpu",
                 dtype="float32", sample_rate=24000, frame_rate=12.5, voices=("aiden",),
                 default_voice="aiden", languages=("english",))


class _NoText:
    supported = False


class PacedWorker:
    def __init__(self, max_streams: int, max_queue: int = 0):
        self.max_streams = max_streams
        self.max_outstanding = max_streams + max_queue
        self.label = "paced"
        self.texts = _NoText()
        self.metrics = Metrics()
        self.engine_metrics = self.metrics.engine(self.label)
        self.engine_metrics.stream_slots.set(max_streams)
        self.failure = None
        self.watchdog_tick = None
        self._streams: dict = {}  # handle -> [frames made, frames posted, next frame time, chunks]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._kick = threading.Event()  # a new stream: its first frame at once, as the engine loop wakes
        self._frame = np.linspace(-0.5, 0.5, SAMPLES_PER_FRAME, dtype=np.float32)
        threading.Thread(target=self._run, name="paced-engine", daemon=True).start()

    num_outstanding = property(lambda self: len(self._streams))

    def add_fatal_listener(self, fn) -> None:
        pass

    def _wake(self) -> None:
        pass

    def submit(self, request, loop) -> StreamHandle:
        return self.enqueue(StreamHandle(request, loop, None))

    def enqueue(self, handle: StreamHandle) -> StreamHandle:
        handle._wake = self._wake
        with self._lock:
            if len(self._streams) >= self.max_outstanding:
                raise Overloaded(f"all {self.max_streams} synthesis streams are busy")
            self._streams[handle] = [0, 0, time.monotonic(), 0]
        self._kick.set()
        return handle

    def stop(self, timeout=None) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._kick.wait(0.002)
            self._kick.clear()
            now = time.monotonic()
            with self._lock:
                items = list(self._streams.items())
            for handle, st in items:
                if handle.cancelled:
                    self._end(handle, StreamEnd(FinishReason.CANCELLED, st[0], st[1] * SAMPLES_PER_FRAME))
                    continue
                limit = handle.request.max_frames
                while st[2] <= now and st[0] < limit:
                    st[0] += 1
                    st[2] += FRAME_S
                pending, last = st[0] - st[1], st[0] >= limit
                if pending and (pending >= CHUNKS[min(st[3], len(CHUNKS) - 1)] or last):
                    handle.post(AudioChunk(np.tile(self._frame, pending), st[1] * SAMPLES_PER_FRAME,
                                           pending, st[3]))
                    st[1], st[3] = st[0], st[3] + 1
                    self.engine_metrics.frames.inc(pending)
                if last and st[1] == st[0]:
                    self._end(handle, StreamEnd(FinishReason.MAX_LENGTH, st[0], st[0] * SAMPLES_PER_FRAME))

    def _end(self, handle, end: StreamEnd) -> None:
        handle.post(end)
        with self._lock:
            self._streams.pop(handle, None)


@dataclass
class PacedApp:
    worker: PacedWorker
    info: ModelInfo


def build(config) -> PacedApp:
    """The engine process's app for `TTS_ENGINE_FACTORY=tts_server.testing.paced:build`."""
    max_streams = config.max_streams or 256
    max_queue = max_streams if config.max_queue is None else config.max_queue
    return PacedApp(PacedWorker(max_streams, max_queue), INFO)
