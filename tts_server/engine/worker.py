"""The engine thread: admits requests into slots, steps all active streams one frame at a
time, decodes finished frames into audio chunks and posts them to each stream's handle."""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time

import torch

from ..api import (AudioChunk, FinishReason, InvalidRequest, Overloaded, ShuttingDown, StreamEnd,
                   SynthesisRequest)
from ..codec.pcm import StreamResampler
from ..config import ServerConfig
from .prepare import RequestPreparer
from .stream import ActiveStream, StreamHandle

log = logging.getLogger(__name__)


class Worker:
    """Owns the decode engine and the codec; every torch call happens on its thread."""

    def __init__(self, loaded, engine, codec, config: ServerConfig):
        self.engine = engine
        self.codec = codec
        self.preparer = RequestPreparer(loaded)
        self.max_streams = min(config.max_streams, engine.max_streams)
        self.max_outstanding = self.max_streams + config.max_queue
        self.chunk_frames = config.chunk_frames
        self.frame_s = codec.samples_per_frame / codec.sample_rate
        # Emit early whenever a player that started at the first chunk has less than this left,
        # as long as the engine loop has slack: a codec call costs about the same for 1 frame as
        # for 8, so extra calls on a saturated loop would only slow every stream down.
        self.min_lead_s = 2.5 * self.frame_s
        self.max_early_step_s = 0.75 * self.frame_s
        self.step_s = 0.0  # moving average of one loop iteration (engine step + chunk decodes)
        self._cond = threading.Condition()
        self._incoming: collections.deque[StreamHandle] = collections.deque()
        self._waiting: collections.deque[StreamHandle] = collections.deque()
        self._active: dict[int, ActiveStream] = {}
        self._free_slots = list(range(self.max_streams))[::-1]
        self._outstanding = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tts-engine", daemon=True)
        self.frames_generated = 0

    # ---- any thread -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    @property
    def num_outstanding(self) -> int:
        """Streams submitted and not yet ended (active + waiting)."""
        return self._outstanding

    @property
    def num_active(self) -> int:
        return len(self._active)

    def submit(self, request: SynthesisRequest, loop: asyncio.AbstractEventLoop) -> StreamHandle:
        handle = StreamHandle(request, loop, self._wake)
        with self._cond:
            if self._stopping:
                raise ShuttingDown("server is shutting down")
            if self._outstanding >= self.max_outstanding:
                raise Overloaded(f"all {self.max_streams} synthesis streams are busy")
            self._outstanding += 1
            self._incoming.append(handle)
            self._cond.notify()
        return handle

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    # ---- engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while not (self._incoming or self._active or self._stopping
                           or (self._waiting and self._free_slots)):
                    self._cond.wait()
                if self._stopping:
                    break
                self._waiting.extend(self._incoming)
                self._incoming.clear()
            self._reap_cancelled()
            while self._waiting and self._free_slots:
                self._admit(self._waiting.popleft())
            if self._active:
                self._step()
        for handle in list(self._waiting) + list(self._incoming):
            self._end(handle, None, FinishReason.CANCELLED, 0, 0)
        for stream in list(self._active.values()):
            self._finish(stream, FinishReason.CANCELLED)

    def _end(self, handle, slot, reason, frames, samples, error=None) -> None:
        if slot is not None:
            self._active.pop(slot, None)
            self.engine.release(slot)
            self._free_slots.append(slot)
        with self._cond:
            self._outstanding -= 1
        handle.post(StreamEnd(reason, frames, samples, error))

    def _finish(self, stream: ActiveStream, reason: FinishReason, error=None) -> None:
        self._end(stream.handle, stream.slot, reason, stream.num_frames, stream.num_samples, error)

    def _reap_cancelled(self) -> None:
        for handle in [h for h in self._waiting if h.cancelled]:
            self._waiting.remove(handle)
            self._end(handle, None, FinishReason.CANCELLED, 0, 0)
        for stream in [s for s in self._active.values() if s.handle.cancelled]:
            log.info("request %s cancelled after %d frames", stream.handle.request.request_id,
                     stream.num_frames)
            self._finish(stream, FinishReason.CANCELLED)

    def _admit(self, handle: StreamHandle) -> None:
        if handle.cancelled:
            self._end(handle, None, FinishReason.CANCELLED, 0, 0)
            return
        req = handle.request
        slot = self._free_slots.pop()
        try:
            prepared = self.preparer.prepare(req)
            room = self.engine.max_positions - prepared.prompt.embeds.shape[0] - 1
            if room < 1:
                raise InvalidRequest("text", "too long for the model's context")
            self.engine.prefill(slot, prepared.prompt, req.sampling)
            state = self.codec.new_state()
            if prepared.ref_codes is not None:
                self.codec.decode(state, prepared.ref_codes)  # left context only
        except Exception as e:  # noqa: BLE001 - reported to this stream only
            self.engine.release(slot)
            self._free_slots.append(slot)
            if not isinstance(e, InvalidRequest):
                log.exception("request %s failed in prefill", req.request_id)
            self._end(handle, None, FinishReason.ERROR, 0, 0, e)
            return
        self._active[slot] = ActiveStream(
            handle=handle, slot=slot, codec_state=state,
            resample=StreamResampler(self.codec.sample_rate, req.output_sample_rate),
            max_frames=min(req.max_frames, room))

    def _step(self) -> None:
        t0 = time.monotonic()
        self._step_streams()
        self.step_s = 0.9 * self.step_s + 0.1 * (time.monotonic() - t0)

    def _step_streams(self) -> None:
        slots = list(self._active)
        try:
            results = self.engine.step(slots)
        except Exception as e:  # noqa: BLE001 - a failed step fails the streams in it
            log.exception("decode step failed for %d streams", len(slots))
            for slot in slots:
                self._finish(self._active[slot], FinishReason.ERROR, e)
            return
        self.frames_generated += len(results)
        for result in results:
            stream = self._active[result.slot]
            stream.pending.append(result.codes)
            stream.num_frames += 1
            done = result.next_is_eos or stream.num_frames >= stream.max_frames
            if done or self._chunk_due(stream):
                try:
                    self._emit(stream, last=done)
                except Exception as e:  # noqa: BLE001
                    log.exception("codec decode failed for %s", stream.handle.request.request_id)
                    self._finish(stream, FinishReason.ERROR, e)
                    continue
            if done:
                reason = FinishReason.EOS if result.next_is_eos else FinishReason.MAX_LENGTH
                self._finish(stream, reason)

    def _chunk_due(self, stream: ActiveStream) -> bool:
        """Chunks follow the schedule (small first, then larger to save per-call overhead),
        except when synthesis runs near real time: then every frame goes out at once, so a
        player that started at the first chunk does not run dry waiting for a full chunk."""
        schedule = self.chunk_frames
        if len(stream.pending) >= schedule[min(stream.num_chunks, len(schedule) - 1)]:
            return True
        if stream.first_chunk_at is None or self.step_s > self.max_early_step_s:
            return False
        played = time.monotonic() - stream.first_chunk_at
        return stream.frames_emitted * self.frame_s - played < self.min_lead_s

    def _emit(self, stream: ActiveStream, last: bool) -> None:
        codes = torch.from_numpy(stream.take_codes())
        num_frames = codes.shape[0]
        stream.frames_emitted += num_frames
        audio = self.codec.decode(stream.codec_state, codes).float().cpu().numpy()
        samples = stream.resample(audio, last=last)
        if samples.size == 0:  # the resampler's start-up delay swallowed a tiny first chunk
            return
        stream.handle.post(AudioChunk(samples=samples, sample_offset=stream.num_samples,
                                      num_frames=num_frames, sequence_number=stream.num_chunks))
        if stream.first_chunk_at is None:
            stream.first_chunk_at = time.monotonic()
        stream.num_samples += samples.shape[0]
        stream.num_chunks += 1
