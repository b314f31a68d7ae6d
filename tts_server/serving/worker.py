"""The engine thread: admits requests into slots, steps all active streams one frame at a
time, decodes finished frames into audio chunks and posts them to each stream's handle.

Failure handling: a fault confined to one stream (its prefill, a non-finite logits check, its
codec decode) ends that stream with an error and the others carry on. A fault of the engine as
a whole (a device error, or a step the watchdog finds hung) ends every stream with
`EngineFailure` and tells the listeners (the server flips health to NOT_SERVING and exits
non-zero so that its supervisor restarts it)."""

from __future__ import annotations

import asyncio
import collections
import logging
import sys
import threading
import time
import traceback

import torch

from ..api import (AudioChunk, EngineFailure, FinishReason, InvalidRequest, Overloaded,
                   ShuttingDown, StreamEnd, StreamFailure, SynthesisRequest)
from ..codec.pcm import StreamResampler
from ..config import ServerConfig
from ..metrics import Metrics
from .prepare import RequestPreparer
from .stream import ActiveStream, StreamHandle

log = logging.getLogger(__name__)

DEVICE_FAULT_MARKERS = ("CUDA error", "CUBLAS_STATUS", "cuDNN error", "CUDNN_STATUS", "megakernel:",
                        "device-side assert")


def is_device_fault(e: BaseException) -> bool:
    """Errors after which the device (and every stream on it) is unusable; CUDA errors are sticky."""
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(e, accel):
        return True
    return any(m in str(e) for m in DEVICE_FAULT_MARKERS)


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
        self.max_queue_wait_s = config.max_queue_wait_s
        self.max_buffer_s = config.max_buffer_s
        self.watchdog_s = config.watchdog_s
        self.metrics = Metrics()
        self.metrics.active_streams.set_function(lambda: self.num_active)
        self.metrics.queued_streams.set_function(lambda: len(self._waiting) + len(self._incoming))
        self.metrics.paused_streams.set_function(lambda: self.num_paused)
        self.failure: EngineFailure | None = None  # set once the engine is unusable
        self._fatal_listeners: list = []
        self.busy_since: float | None = None  # monotonic start of the engine call in progress
        self.busy_what = ""
        self.watchdog_tick = None  # called on every watchdog poll (the process backstop)
        self._kicked = False
        self._cond = threading.Condition()
        self._incoming: collections.deque[StreamHandle] = collections.deque()
        self._waiting: collections.deque[StreamHandle] = collections.deque()
        self._active: dict[int, ActiveStream] = {}
        self._free_slots = list(range(self.max_streams))[::-1]
        self._outstanding = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tts-engine", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="tts-watchdog", daemon=True)
        self.frames_generated = 0

    # ---- any thread -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        if self.watchdog_s > 0:
            self._watchdog.start()

    def add_fatal_listener(self, fn) -> None:
        """fn(EngineFailure) is called once, from the engine or watchdog thread, if the engine dies."""
        self._fatal_listeners.append(fn)

    @property
    def num_paused(self) -> int:
        return sum(1 for s in list(self._active.values()) if s.handle.paused)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

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
            if self.failure is not None:
                raise EngineFailure(f"the decode engine failed ({self.failure}); restarting")
            if self._stopping:
                raise ShuttingDown("server is shutting down")
            if self._outstanding >= self.max_outstanding:
                raise Overloaded(f"all {self.max_streams} synthesis streams are busy and "
                                 f"{self.max_outstanding - self.max_streams} requests are queued")
            self._outstanding += 1
            self._incoming.append(handle)
            self._cond.notify()
        return handle

    def _wake(self) -> None:
        with self._cond:
            self._kicked = True
            self._cond.notify()

    def fail(self, failure: EngineFailure) -> None:
        """The engine is unusable: end every stream with `failure` (any thread; the engine
        thread may be stuck inside a step) and tell the listeners. Idempotent."""
        with self._cond:
            if self.failure is not None:
                return
            self.failure = failure
            handles = (list(self._incoming) + list(self._waiting)
                       + [s.handle for s in list(self._active.values())])
            self._cond.notify()
        log.critical("decode engine failed: %s; ending %d streams", failure, len(handles))
        self.metrics.engine_healthy.set(0)
        for handle in handles:
            handle.post(StreamEnd(FinishReason.ERROR, 0, 0, failure))
        for fn in self._fatal_listeners:
            try:
                fn(failure)
            except Exception:  # noqa: BLE001
                log.exception("fatal listener failed")

    def _watch(self) -> None:
        period = min(1.0, self.watchdog_s / 4)
        while self.failure is None and not (self._stopping and not self._thread.is_alive()):
            time.sleep(period)
            if self.watchdog_tick is not None:
                self.watchdog_tick()
            since = self.busy_since
            if since is None or time.monotonic() - since <= self.watchdog_s:
                continue
            frame = sys._current_frames().get(self._thread.ident)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "?"
            log.critical("watchdog: %s has not returned after %.1f s; engine thread stack:\n%s",
                         self.busy_what, time.monotonic() - since, stack)
            self.fail(EngineFailure(f"{self.busy_what} hung for more than {self.watchdog_s:g} s"))

    # ---- engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - a bug in the loop itself: fail loudly
            log.exception("engine loop crashed")
            self.fail(EngineFailure(f"engine loop crashed: {e!r}"))
            return
        if self.failure is not None:
            return
        for handle in list(self._waiting) + list(self._incoming):
            self._end(handle, None, FinishReason.CANCELLED, 0, 0)
        for stream in list(self._active.values()):
            self._finish(stream, FinishReason.CANCELLED)

    def _runnable(self) -> list[ActiveStream]:
        """Active streams whose client keeps up (the others are paused this iteration)."""
        out = []
        for stream in self._active.values():
            h = stream.handle
            h.paused = h.backlog_s() > self.max_buffer_s
            if not h.paused:
                out.append(stream)
        return out

    def _wait_timeout(self) -> float | None:
        timeouts = []
        if self._waiting:
            oldest = self._waiting[0].submitted_at
            timeouts.append(max(0.0, oldest + self.max_queue_wait_s - time.monotonic()) + 1e-3)
        if self._active:  # paused streams: look again soon even if no chunk is acknowledged
            timeouts.append(0.05)
        return min(timeouts) if timeouts else None

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self.failure is not None or self._incoming
                           or self._kicked or (self._waiting and self._free_slots)
                           or self._runnable()):
                    timeout = self._wait_timeout()
                    if not self._cond.wait(timeout) and timeout is not None:
                        break  # timed out: reap the queue, look at paused streams
                self._kicked = False
                if self._stopping or self.failure is not None:
                    return
                self._waiting.extend(self._incoming)
                self._incoming.clear()
            self._reap()
            while self._waiting and self._free_slots and self.failure is None:
                self._admit(self._waiting.popleft())
            runnable = self._runnable()
            if runnable and self.failure is None:
                self._step(runnable)

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

    def _reap(self) -> None:
        """Drop cancelled streams, and queued requests that waited too long for a slot."""
        now = time.monotonic()
        for handle in [h for h in self._waiting if h.cancelled]:
            self._waiting.remove(handle)
            self._end(handle, None, FinishReason.CANCELLED, 0, 0)
        while self._waiting and now - self._waiting[0].submitted_at > self.max_queue_wait_s:
            handle = self._waiting.popleft()
            log.warning("request %s: no synthesis slot free within %.1f s", handle.request.request_id,
                        self.max_queue_wait_s, extra={"request_id": handle.request.request_id})
            self._end(handle, None, FinishReason.ERROR, 0, 0, Overloaded(
                f"no synthesis slot became free within {self.max_queue_wait_s:g} s"))
        for stream in [s for s in self._active.values() if s.handle.cancelled]:
            rid = stream.handle.request.request_id
            log.info("request %s cancelled after %d frames", rid, stream.num_frames,
                     extra={"request_id": rid, "frames": stream.num_frames})
            self._finish(stream, FinishReason.CANCELLED)

    def _busy(self, what: str | None) -> None:
        """Mark the start (or, with None, the end) of an engine call the watchdog times."""
        self.busy_what = what or ""
        self.busy_since = time.monotonic() if what else None

    def _admit(self, handle: StreamHandle) -> None:
        if handle.cancelled:
            self._end(handle, None, FinishReason.CANCELLED, 0, 0)
            return
        req = handle.request
        self.metrics.queue_wait.observe(time.monotonic() - handle.submitted_at)
        slot = self._free_slots.pop()
        self._busy(f"prefill of request {req.request_id}")
        try:
            prepared = self.preparer.prepare(req)
            room = self.engine.max_positions - prepared.prompt.embeds.shape[0] - 1
            if room < 1:
                raise InvalidRequest("text", "too long for the model's context")
            if hasattr(self.engine, "bind_request"):  # fault injection (tests)
                self.engine.bind_request(slot, req.request_id)
            self.engine.prefill(slot, prepared.prompt, req.sampling)
            state = self.codec.new_state()
            if prepared.ref_codes is not None:
                self.codec.decode(state, prepared.ref_codes)  # left context only
        except Exception as e:  # noqa: BLE001 - reported to this stream only
            self._busy(None)
            if self.failure is not None:
                return
            if is_device_fault(e):
                self.fail(EngineFailure(f"device fault in prefill: {e}"))
                return
            self.engine.release(slot)
            self._free_slots.append(slot)
            if not isinstance(e, InvalidRequest):
                log.exception("request %s failed in prefill", req.request_id,
                              extra={"request_id": req.request_id})
            self._end(handle, None, FinishReason.ERROR, 0, 0, e)
            return
        self._busy(None)
        if self.failure is not None:
            return
        self._active[slot] = ActiveStream(
            handle=handle, slot=slot, codec_state=state,
            resample=StreamResampler(self.codec.sample_rate, req.output_sample_rate),
            max_frames=min(req.max_frames, room))

    def _step(self, streams: list[ActiveStream]) -> None:
        t0 = time.monotonic()
        self._busy(f"decode step of {len(streams)} streams")
        try:
            self._step_streams(streams)
        finally:
            self._busy(None)
        dt = time.monotonic() - t0
        self.metrics.step.observe(dt)
        self.step_s = 0.9 * self.step_s + 0.1 * dt

    def _step_streams(self, streams: list[ActiveStream]) -> None:
        slots = [s.slot for s in streams]
        try:
            results = self.engine.step(slots)
        except Exception as e:  # noqa: BLE001 - a failed step fails the streams in it
            if self.failure is not None:
                return
            if is_device_fault(e):
                self.fail(EngineFailure(f"device fault in a decode step: {e}"))
                return
            log.exception("decode step failed for %d streams", len(slots))
            for slot in slots:
                self._finish(self._active[slot], FinishReason.ERROR, StreamFailure(str(e)))
            return
        if self.failure is not None:  # the watchdog gave up on this step meanwhile
            return
        self.frames_generated += len(results)
        self.metrics.frames.inc(len(results))
        for result in results:
            stream = self._active[result.slot]
            if result.error is not None:
                rid = stream.handle.request.request_id
                log.error("request %s failed in the engine at frame %d: %s", rid,
                          stream.num_frames + 1, result.error, extra={"request_id": rid})
                self._finish(stream, FinishReason.ERROR, StreamFailure(result.error))
                continue
            stream.pending.append(result.codes)
            stream.num_frames += 1
            done = result.next_is_eos or stream.num_frames >= stream.max_frames
            if done or self._chunk_due(stream):
                try:
                    self._emit(stream, last=done)
                except Exception as e:  # noqa: BLE001
                    if is_device_fault(e):
                        self.fail(EngineFailure(f"device fault in the codec: {e}"))
                        return
                    rid = stream.handle.request.request_id
                    log.exception("codec decode failed for %s", rid, extra={"request_id": rid})
                    self._finish(stream, FinishReason.ERROR, StreamFailure(f"codec decode: {e}"))
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
