"""One stream's two halves: the asyncio-side handle and the engine-thread state."""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ..api import AudioChunk, FlushAck, StreamEnd, SynthesisRequest, TextEvent, WordTiming


class StreamHandle:
    """What the gRPC handler holds: an async iterator of `AudioChunk`s ending in a `StreamEnd`
    (with `WordTiming`s and `FlushAck`s between for StreamSynthesize contexts, whose text comes
    in through `push_text`). `cancel()` (idempotent, any thread) makes the engine drop the stream
    at its next step."""

    def __init__(self, request: SynthesisRequest, loop: asyncio.AbstractEventLoop, wake):
        self.request = request
        self.text_ids: list[int] | None = None  # the prompt's token ids, once tokenized
        self.submitted_at = time.monotonic()
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()
        self._wake = wake
        # Flow control: samples posted by the engine vs. written to the client by the handler.
        # The engine pauses a stream whose backlog exceeds its buffer bound (a client that
        # stopped reading), so a stalled client costs bounded memory.
        self.posted_samples = 0
        self.sent_samples = 0
        self.paused = False
        self.ended = False
        # StreamSynthesize: client text events (any thread -> engine thread), and the engine
        # thread's serving.text_track.TextTrack
        self.text_events: collections.deque[TextEvent] = collections.deque()
        self.track = None

    @property
    def ready(self) -> bool:
        """Admissible: any one-shot request; a context once its first token is there."""
        return not self.request.incremental or (self.track is not None and self.track.ready)

    def push_text(self, event: TextEvent) -> None:
        """Handler side: a text delta, flush or end for this context."""
        self.text_events.append(event)
        self._wake()

    def backlog_s(self) -> float:
        return (self.posted_samples - self.sent_samples) / self.request.output_sample_rate

    def mark_sent(self, num_samples: int) -> None:
        """Handler side: `num_samples` more have been handed to the transport."""
        self.sent_samples += num_samples
        if self.paused:
            self._wake()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        if not self._cancelled.is_set():
            self._cancelled.set()
            self._wake()

    def account(self, event: AudioChunk | StreamEnd | WordTiming | FlushAck) -> bool:
        """Counts a posted event (samples, the end); False for anything after the stream's end
        (a stream ended by the watchdog while its step was hung), which is dropped."""
        if self.ended:
            return False
        if isinstance(event, StreamEnd):
            self.ended = True
        elif isinstance(event, AudioChunk):
            self.posted_samples += event.samples.shape[0]
        return True

    def post(self, event: AudioChunk | StreamEnd | WordTiming | FlushAck) -> None:
        """Engine thread -> event loop. Drops the event if the loop has closed, and anything
        after the stream's end."""
        if not self.account(event):
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:
            pass

    def __aiter__(self):
        return self._events()

    async def _events(self):
        while True:
            event = await self._queue.get()
            yield event
            if isinstance(event, StreamEnd):
                return


@dataclass
class Stream:
    """Engine-thread state of an admitted stream (torch-free: the scheduler reads it too)."""

    handle: StreamHandle
    slot: int
    max_frames: int
    resample: object  # codec.resample.StreamResampler: fed one frame at a time
    num_frames: int = 0  # frames generated
    pending: list = field(default_factory=list)  # resampled audio not yet posted
    pending_frames: int = 0
    num_samples: int = 0  # posted, at the output rate
    num_chunks: int = 0
    frames_emitted: int = 0
    first_chunk_at: float | None = None  # monotonic time the first chunk was posted
    timings: dict = field(default_factory=dict)  # first-audio breakdown (ms), see serving/loop.py

    def lead_s(self, now: float, frame_s: float) -> float:
        """Audio posted ahead of a player that started at the first chunk (inf before it)."""
        if self.first_chunk_at is None:
            return float("inf")
        return self.frames_emitted * frame_s - (now - self.first_chunk_at)

    def text_dry(self) -> bool:
        """A StreamSynthesize context whose engine text track has no vector for the next frame."""
        track = self.handle.track
        return track is not None and track.is_dry(self.num_frames)

    def take_audio(self) -> np.ndarray:
        samples = np.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]
        self.pending.clear()
        return samples
