"""The engine thread: one step at a time for every stream, prefill folded in.

Each iteration: the scheduler picks admissions and the streams to step -> the requests are
prepared (tokenize, voice clone, prompt) -> ONE engine call (`run(StepPlan)`) advances every
stream by a frame -> ONE batched codec step turns all new frames into audio -> each stream's
frame is resampled and grouped into chunks for its handle. An engine that can hands the frames'
codes over before its talker step ends (`on_codes`): the codec step then runs, on its own CUDA
stream, while the talker step does, and the audio goes out before the engine call returns;
streams end (EOS, length, errors) only after it. With `--early-codec` (ServerConfig.early_codec)
the codec step is queued at once on the frame's codes on the device (`on_launch`), so it starts
when they exist rather than after a host round trip; its audio is collected in the same place.

Failure handling: a fault confined to one stream (its preparation or prefill, non-finite logits)
ends that stream with an error and the others carry on. A fault of the engine as a whole (a
device error, or a step the watchdog finds hung) ends every stream with `EngineFailure` and
tells the listeners (the server flips health to NOT_SERVING and exits non-zero so that its
supervisor restarts it)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import sys
import threading
import time
import traceback

import numpy as np
import torch

from ..api import (AudioChunk, EngineFailure, FinishReason, InvalidRequest, Overloaded,
                   ShuttingDown, StreamEnd, StreamFailure, SynthesisRequest, Unsupported)
from ..codec.pcm import StreamResampler
from ..config import ServerConfig
from ..engines.contract import Admission, StepOutput, StepPlan
from ..metrics import Metrics
from .prepare import RequestPreparer
from .scheduler import PrefillCost, Scheduler, SchedulerConfig, StepCost
from .streams import Stream, StreamHandle
from .text_feed import TextFeeder

log = logging.getLogger(__name__)

MAX_PRIMED_VOICES = 16  # codec slot states kept (~slot_state_bytes each: a few MB on a GPU)
DEVICE_FAULT_MARKERS = ("CUDA error", "CUBLAS_STATUS", "cuDNN error", "CUDNN_STATUS", "megakernel:",
                        "device-side assert")


def is_device_fault(e: BaseException) -> bool:
    """Errors after which the device (and every stream on it) is unusable; CUDA errors are sticky."""
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(e, accel):
        return True
    return any(m in str(e) for m in DEVICE_FAULT_MARKERS)


def _ref_codes(built):
    """A built admission's voice-clone reference codes (None: no clone, or it failed to build)."""
    prepared = built[0] if isinstance(built, tuple) else built
    return getattr(prepared, "ref_codes", None)


class _StepAudio:
    """One step's bookkeeping between the engine's early codes and the end of its call."""

    def __init__(self, admitted: list[Stream], t0: float, t_run: float):
        self.admitted, self.t0, self.t_run = admitted, t0, t_run
        self.reported: set[int] = set()  # slots whose codes went to the codec
        self.errors: dict[int, StreamFailure] = {}  # slots whose codec step failed
        self.launched: dict[int, tuple] = {}  # slot -> (codec launch, its row): queued on device codes
        self.t_engine: float | None = None  # codes on the host
        self.t_codec: float | None = None  # their audio decoded


class Worker:
    """Owns the decode engine and the codec; every torch call happens on its thread. `metrics`
    is the server's registry (shared by the engines of one server); `label` names this engine's
    device there and in logs."""

    def __init__(self, loaded, engine, codec, config: ServerConfig, metrics: Metrics | None = None,
                 label: str | None = None):
        self.engine = engine
        self.device = loaded.device
        self.label = label or str(loaded.device)
        self.codec = codec
        self.preparer = RequestPreparer(loaded)
        self.max_streams = min(config.max_streams or engine.max_streams, engine.max_streams,
                               codec.max_slots)
        max_queue = self.max_streams if config.max_queue is None else config.max_queue
        self.max_outstanding = self.max_streams + max_queue
        self.frame_s = codec.samples_per_frame / codec.sample_rate
        self.scheduler = Scheduler(SchedulerConfig(
            max_streams=self.max_streams, frame_s=self.frame_s, chunk_frames=config.chunk_frames,
            max_queue_wait_s=config.max_queue_wait_s, max_buffer_s=config.max_buffer_s,
            preroll_s=config.player_preroll_ms / 1e3,
            sit_out=os.environ.get("TTS_SIT_OUT", "1") != "0"))  # 0: every runnable stream steps (A/B)
        self.watchdog_s = config.watchdog_s
        self.texts = TextFeeder(self.preparer, engine, config.idle_text_timeout_s, config.max_text_chars,
                                codec.samples_per_frame, codec.sample_rate, self.frame_s)
        # the cost model of a step's admissions, and a moving average of a step without them
        self.prefill_cost = PrefillCost()
        self.step_cost = StepCost()
        self._admit_s = 0.0  # this step's preparation + prefill
        self._codec_resets: list[int] = []  # admitted slots whose codec state is zeroed later
        self.metrics = metrics or Metrics()
        m = self.engine_metrics = self.metrics.engine(self.label)
        m.active_streams.set_function(lambda: self.num_active)
        m.queued_streams.set_function(lambda: len(self.scheduler.waiting) + len(self._incoming))
        m.paused_streams.set_function(lambda: self.num_paused)
        m.stream_slots.set(self.max_streams)
        self.failure: EngineFailure | None = None  # set once the engine is unusable
        self._fatal_listeners: list = []
        self.busy_since: float | None = None  # monotonic start of the engine call in progress
        self.busy_what = ""
        self.watchdog_tick = None  # called on every watchdog poll (the process backstop)
        self._kicked = False
        self._cond = threading.Condition()
        self._incoming: list[StreamHandle] = []
        self._outstanding = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"tts-engine-{self.label}", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name=f"tts-watchdog-{self.label}", daemon=True)
        self.frames_generated = 0
        # codec states primed with a voice clone's reference frames, by the reference's hash
        self._primed: collections.OrderedDict[str, list] = collections.OrderedDict()
        self.primed_voice_hits = 0
        # diagnostics: TTS_STEP_TRACE=<path> appends one JSON line per step (benchmark scripts)
        trace = os.environ.get("TTS_STEP_TRACE")
        self._trace = open(trace, "a", buffering=1) if trace else None  # line-buffered
        self._trace_t0 = time.monotonic() - time.time()  # monotonic -> unix time, for lining up with clients
        self._trace_rec: dict = {}
        # the codec runs on its own CUDA stream: a step's audio decodes while the engine's talker
        # step (on the default stream) still runs
        self._codec_cuda = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # the codec queued on the frame's device codes as soon as it is launched (engines that can)
        self._launch_codec = (config.early_codec and bool(getattr(engine, "launches_codes", False))
                              and hasattr(codec, "launch"))

    # ---- any thread -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        if self.watchdog_s > 0:
            self._watchdog.start()

    def add_fatal_listener(self, fn) -> None:
        """fn(EngineFailure) is called once, from the engine or watchdog thread, if the engine dies."""
        self._fatal_listeners.append(fn)

    @property
    def _active(self) -> dict[int, Stream]:
        return self.scheduler.active

    @property
    def num_paused(self) -> int:
        return sum(1 for s in list(self._active.values()) if s.handle.paused)

    @property
    def num_free_slots(self) -> int:
        return len(self.scheduler.free_slots)

    @property
    def num_outstanding(self) -> int:
        """Streams submitted and not yet ended (active + waiting)."""
        return self._outstanding

    @property
    def num_active(self) -> int:
        return len(self._active)

    def stop(self, timeout: float | None = None) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    def submit(self, request: SynthesisRequest, loop: asyncio.AbstractEventLoop) -> StreamHandle:
        return self.enqueue(StreamHandle(request, loop, self._wake))

    def enqueue(self, handle: StreamHandle) -> StreamHandle:
        """submit() for a handle made by the caller (the engine process's, which posts to its
        pipe); raises as submit() does."""
        request = handle.request
        handle._wake = self._wake
        if request.incremental and not self.texts.supported:
            raise Unsupported(f"the {self.engine.name} engine does not take incremental text; "
                              "use Synthesize, or --engine torch/batched")
        if not request.incremental:  # (a StreamSynthesize context's text comes later)
            # tokenized here, in the caller's thread: the engine thread's time is the server's capacity
            handle.text_ids = self.preparer.text_ids(request.text)
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
            handles = (list(self._incoming) + list(self.scheduler.waiting)
                       + [s.handle for s in list(self._active.values())])
            self._cond.notify()
        log.critical("decode engine on %s failed: %s; ending %d streams", self.label, failure,
                     len(handles))
        self.engine_metrics.engine_healthy.set(0)
        self.engine_metrics.stream_slots.set(0)
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
    def _codec_stream(self):
        """Every codec call runs inside: its own CUDA stream (ordered with itself only)."""
        return torch.cuda.stream(self._codec_cuda) if self._codec_cuda is not None else contextlib.nullcontext()

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # kernels and graphs launch on this engine's GPU
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - a bug in the loop itself: fail loudly
            log.exception("engine loop crashed")
            self.fail(EngineFailure(f"engine loop crashed: {type(e).__name__}: {e}"))
            return
        if self.failure is not None:
            return
        for handle in list(self.scheduler.waiting) + self._incoming:
            self._end(handle, None, FinishReason.CANCELLED)
        self.scheduler.waiting.clear()
        for stream in list(self._active.values()):
            self._finish(stream, FinishReason.CANCELLED)

    def _has_work(self) -> bool:
        sch = self.scheduler
        return bool(self._incoming or self._kicked or (sch.free_slots and sch.ready()) or sch.runnable())

    def _loop(self) -> None:
        sch = self.scheduler
        while True:
            with self._cond:
                while not (self._stopping or self.failure is not None or self._has_work()):
                    timeout = sch.wait_timeout(time.monotonic())
                    if not self._cond.wait(timeout) and timeout is not None:
                        break  # timed out: reap the queue, look at paused streams
                self._kicked = False
                if self._stopping or self.failure is not None:
                    return
                sch.waiting.extend(self._incoming)
                self._incoming.clear()
            self._feed_text()
            self._reap()
            plan = sch.plan(time.monotonic(), self.prefill_cost, self.step_cost)
            if (plan.admit or plan.step) and self.failure is None:
                self._step(plan)

    def _end(self, handle: StreamHandle, slot: int | None, reason: FinishReason, frames: int = 0,
             samples: int = 0, error: BaseException | None = None) -> None:
        if slot is not None:
            self.engine.release(slot)
            self.scheduler.release(slot)
        with self._cond:
            self._outstanding -= 1
        handle.post(StreamEnd(reason, frames, samples, error))

    def _finish(self, stream: Stream, reason: FinishReason, error=None) -> None:
        self._end(stream.handle, stream.slot, reason, stream.num_frames, stream.num_samples, error)

    def _feed_text(self) -> None:
        """StreamSynthesize contexts: client text into their tracks, new tokens into the engine;
        contexts with bad text or idle too long end (only they)."""
        sch, now = self.scheduler, time.monotonic()
        by_handle = {s.handle: s for s in self._active.values()}
        for handle, reason, error in self.texts.drain(list(sch.waiting) + list(by_handle), now):
            rid = handle.request.request_id
            log.info("request %s: %s", rid, error, extra={"request_id": rid})
            if handle in by_handle:
                self._finish(by_handle.pop(handle), reason, error)
            else:
                sch.waiting.remove(handle)
                self._end(handle, None, reason, error=error)
        for handle in sch.waiting:
            self.texts.waiting_acks(handle)
        for handle, stream in by_handle.items():
            if handle.track is None or handle.cancelled:
                continue
            try:
                self.texts.feed(stream, now)
            except Exception as e:  # noqa: BLE001 - this context only, unless the device broke
                if self._fault(e, "a text-track update"):
                    return
                log.exception("request %s: text-track update failed", handle.request.request_id)
                self._finish(stream, FinishReason.ERROR, StreamFailure(str(e)))

    def _reap(self) -> None:
        """Drop cancelled streams, and queued requests that waited too long for a slot."""
        cancelled, too_long, gone = self.scheduler.expired(time.monotonic())
        for handle in cancelled:
            self._end(handle, None, FinishReason.CANCELLED)
        wait_s = self.scheduler.cfg.max_queue_wait_s
        for handle in too_long:
            rid = handle.request.request_id
            log.warning("request %s: no synthesis slot free within %.1f s", rid, wait_s,
                        extra={"request_id": rid})
            self._end(handle, None, FinishReason.ERROR, error=Overloaded(
                f"no synthesis slot became free within {wait_s:g} s"))
        for stream in gone:
            rid = stream.handle.request.request_id
            # the call ended early (cancel, deadline, stall, drain: the servicer logs which)
            log.info("request %s: synthesis stopped after %d frames, slot freed", rid,
                     stream.num_frames,
                     extra={"request_id": rid, "frames": stream.num_frames})
            self._finish(stream, FinishReason.CANCELLED)

    def _busy(self, what: str | None) -> None:
        """Mark the start (or, with None, the end) of an engine call the watchdog times."""
        self.busy_what = what or ""
        self.busy_since = time.monotonic() if what else None

    def _fault(self, e: BaseException, where: str) -> bool:
        """True (after failing the engine) when `e` is a device fault or the engine already failed."""
        if self.failure is not None:
            return True
        if is_device_fault(e):
            self.fail(EngineFailure(f"device fault in {where}: {e}"))
            return True
        return False

    def _prepare_all(self, admit: list[tuple[StreamHandle, int]], now: float) -> list[Admission]:
        """The step's admissions: cancelled ones end here; the others' prompts are built together
        (`prepare_many`: a few device ops for all of them), then each gets its codec state."""
        live = []
        for handle, slot in admit:
            if handle.cancelled:
                self.scheduler.release(slot)
                self._end(handle, None, FinishReason.CANCELLED)
            else:
                live.append((handle, slot))
        whole = [h for h, _ in live if not h.request.incremental]
        texts = [h for h, _ in live if h.request.incremental]
        t0 = time.monotonic()
        try:
            built = dict(zip(whole, self.preparer.prepare_many([h.request for h in whole],
                                                               [h.text_ids for h in whole]))) if whole else {}
            if texts:  # StreamSynthesize contexts: (prepared, eos_from) each
                built.update(zip(texts, self.texts.prompts(texts)))
            # every admitted slot's codec state zeroed at once: a voice clone's now (it then primes
            # or restores it), the others' once the prefill is launched (_flush_codec_resets: off
            # the host's path to the first frame; the codec's stream runs the zeroing first)
            clones = [s for h, s in live if _ref_codes(built[h]) is not None]
            if clones:
                with self._codec_stream():
                    self.codec.reset_many(clones)
            self._codec_resets += [s for _, s in live if s not in clones]
        except Exception as e:  # noqa: BLE001 - reported to each of these streams by _prepare
            built = {h: e for h, _ in live}
        if self._trace is not None:  # prompts + codec reset of the whole step
            self._trace_rec["prompts_s"] = round(time.monotonic() - t0, 5)
        out = (self._prepare(h, s, now, built[h]) for h, s in live)
        return [a for a in out if a is not None]

    def _prepare(self, handle: StreamHandle, slot: int, now: float, built) -> Admission | None:
        """Prompt and codec state for one admission; None (stream ended) when it cannot start.
        built: the request's part of `_prepare_all` (a Prepared, for a StreamSynthesize context
        (Prepared, eos_from), or the exception its preparation raised)."""
        req = handle.request
        self.engine_metrics.queue_wait.observe(now - handle.submitted_at)
        try:
            if isinstance(built, Exception):
                raise built
            prepared, eos_from = built if req.incremental else (built, 0)
            room = self.engine.max_positions - prepared.prompt.embeds.shape[0] - 1
            if room < 1:
                raise InvalidRequest("text", "too long for the model's context")
            if hasattr(self.engine, "bind_request"):  # fault injection (tests)
                self.engine.bind_request(slot, req.request_id)
            self._reset_codec(slot, prepared)
        except Exception as e:  # noqa: BLE001 - reported to this stream only
            if self._fault(e, "request preparation"):
                return None
            self.scheduler.release(slot)
            if not isinstance(e, InvalidRequest):
                log.exception("request %s failed in preparation", req.request_id,
                              extra={"request_id": req.request_id})
            self._end(handle, None, FinishReason.ERROR, error=e)
            return None
        stream = Stream(handle=handle, slot=slot, max_frames=min(req.max_frames, room),
                        resample=StreamResampler(self.codec.sample_rate, req.output_sample_rate))
        stream.timings["queue_ms"] = (now - handle.submitted_at) * 1e3  # submitted -> this step
        self.scheduler.add(stream)
        if req.incremental:
            self.texts.admitted(stream)
        return Admission(slot, prepared.prompt, req.sampling, req.request_id, eos_from)

    def _flush_codec_resets(self) -> None:
        """Zero the codec state of this step's admitted slots (those without a voice clone), queued
        on the codec's stream before its next use; raises as the codec does (the slots stay due)."""
        if self._codec_resets:
            with self._codec_stream():
                self.codec.reset_many(self._codec_resets)
            self._codec_resets = []

    def _reset_codec(self, slot: int, prepared) -> None:
        """The slot's codec state for a new stream. An in-context voice clone primes it with the
        reference's frames (one codec step each, ~1.4 ms on an H100: ~50 ms for a 3 s reference,
        which every running stream would wait for); the primed state is kept per voice, so a
        repeated reference restores it instead (bounded: MAX_PRIMED_VOICES least recently used)."""
        key = prepared.voice_key if prepared.ref_codes is not None else None
        if key is None:
            return  # zeroed with the step's other admissions (_prepare_all)
        with self._codec_stream():
            if key in self._primed:
                self._primed.move_to_end(key)
                self.codec.restore(slot, self._primed[key])
                self.primed_voice_hits += 1
                return
            self.codec.reset(slot, prepared.ref_codes)
            self._primed[key] = self.codec.snapshot(slot)
        if len(self._primed) > MAX_PRIMED_VOICES:
            self._primed.popitem(last=False)

    def _step(self, plan) -> None:
        t0 = time.monotonic()
        self._admit_s = 0.0
        self._busy(f"step of {len(plan.step)} streams with {len(plan.admit)} admissions")
        try:
            admissions = self._prepare_all(plan.admit, t0)
            if self.failure is None:
                self._run_step(plan.step, admissions, t0)
        finally:
            if self._codec_resets and self.failure is None:  # a step that never reached the codec
                try:
                    self._flush_codec_resets()
                except Exception as e:  # noqa: BLE001 - the next admission of these slots resets them
                    if not self._fault(e, "the codec reset"):
                        log.exception("codec reset failed for slots %s", self._codec_resets)
                    self._codec_resets = []
            self._busy(None)
        dt = time.monotonic() - t0
        self.engine_metrics.step.observe(dt)
        num_streams = len(plan.step) + len(admissions)
        if num_streams:  # the step's own cost for that many streams, without its admissions
            self.step_cost.observe(num_streams, dt - self._admit_s)
        if self._trace is not None:
            self._write_trace(t0, dt, plan, len(admissions))

    def _write_trace(self, t0: float, dt: float, plan, num_admitted: int) -> None:
        frame_s = self.scheduler.cfg.frame_s
        leads = [s.lead_s(t0, frame_s) for s in plan.step]
        leads = [x for x in leads if x != float("inf")]
        rec = dict(t=round(t0 - self._trace_t0, 4), dt=round(dt, 5), admit=num_admitted, step=len(plan.step),
                   sat_out=plan.sat_out, waiting=len(self.scheduler.waiting), admit_s=round(self._admit_s, 5),
                   min_lead=round(min(leads), 4) if leads else None, **self._trace_rec)
        self._trace_rec = {}
        self._trace.write(json.dumps(rec) + "\n")

    def _run_step(self, streams: list[Stream], admissions: list[Admission], t0: float) -> None:
        # admitted streams make their first frame in the same step, unless (StreamSynthesize) the
        # prompt holds only the first token: then that frame waits for the next text vector
        admitted = [self._active[a.slot] for a in admissions if not self._active[a.slot].text_dry()]
        slots = tuple(s.slot for s in streams) + tuple(s.slot for s in admitted)
        if not slots and not admissions:
            return
        t_run = time.monotonic()
        step = _StepAudio(admitted, t0, t_run)
        try:
            # the engine hands over the frames' codes early when it can (while its talker step
            # still runs): their audio goes out then; else after the call, the same way
            kw = dict(on_launch=lambda *a: self._launch(step, *a)) if self._launch_codec else {}
            out = self.engine.run(StepPlan(decode=slots, admit=tuple(admissions)),
                                  on_codes=lambda early: self._audio(early, step), **kw)
        except Exception as e:  # noqa: BLE001 - a failed step fails the streams in it
            if self._fault(e, "a decode step"):
                return
            log.exception("decode step failed for %d streams", len(slots))
            for slot in dict.fromkeys(slots + tuple(a.slot for a in admissions)):
                self._finish(self._active[slot], FinishReason.ERROR, StreamFailure(str(e)))
            return
        if self.failure is not None:  # the watchdog gave up on this step meanwhile
            return
        if admissions:
            self._admit_s = (t_run - t0) + out.prefill_s  # preparation + prefill
            self.prefill_cost.observe(len(admissions), self._admit_s)
        for slot, why in out.failed.items():
            stream = self._active[slot]
            rid = stream.handle.request.request_id
            log.error("request %s failed in prefill: %s", rid, why, extra={"request_id": rid})
            self._finish(stream, FinishReason.ERROR, StreamFailure(why))
        late = [r for r in out.frames if r.slot not in step.reported]
        if late:  # an engine without early codes
            self._audio(StepOutput(late, out.failed, out.prefill_s, out.decode_s), step)
            if self.failure is not None:
                return
        if self._trace is not None and step.t_codec is not None:
            self._trace_rec.update(prepare_s=round(t_run - t0, 5), prefill_s=round(out.prefill_s, 5),
                                   decode_s=round(out.decode_s, 5), engine_s=round(step.t_engine - t_run, 5),
                                   codec_s=round(step.t_codec - step.t_engine, 5))
        for result in out.frames:  # the frames' ends, now that the talker steps are known
            stream = self._active.get(result.slot)
            if stream is None or stream.handle.ended:
                continue
            if result.slot in step.errors or result.error is not None:
                error = step.errors.get(result.slot) or StreamFailure(result.error)
                rid = stream.handle.request.request_id
                log.error("request %s failed at frame %d: %s", rid, stream.num_frames + 1, error,
                          extra={"request_id": rid})
                self._finish(stream, FinishReason.ERROR, error)
            elif result.next_is_eos:
                if stream.num_frames < stream.max_frames:  # else its last audio is out already
                    self._add_audio(stream, np.zeros(0, np.float32), last=True)  # what is pending
                self._finish(stream, FinishReason.EOS)
            elif stream.num_frames >= stream.max_frames:
                self._finish(stream, FinishReason.MAX_LENGTH)

    def _launch(self, step: "_StepAudio", slots: list[int], codes, ready) -> None:
        """The engine's on_launch: the codec step of these slots queued at once on the codes'
        device copy (it starts when the frame's codes exist, without a host round trip); its
        audio is collected when the codes reach the host (`_audio`). A failure here leaves
        those slots to `_audio`'s own codec call."""
        try:
            self._flush_codec_resets()
            with self._codec_stream():
                launched = self.codec.launch(slots, codes, ready)
        except Exception:  # noqa: BLE001 - the host path below decodes them instead
            log.exception("queuing the codec on the device codes failed; decoding from the host")
            return
        for row, slot in enumerate(slots):
            step.launched[slot] = (launched, row)

    def _decode_audio(self, step: "_StepAudio", slots: list[int], codes: np.ndarray) -> list[np.ndarray]:
        """These slots' next frame of audio: from the step's launches where every slot has one
        (the codes they decoded are these: the engine's own), else one codec step from the host
        codes."""
        self._flush_codec_resets()
        launches = [step.launched.get(s) for s in slots]
        if all(launches):
            pcm: dict[int, np.ndarray] = {}  # per launch (id), its rows on the host
            out = []
            for launched, row in launches:
                if id(launched) not in pcm:
                    pcm[id(launched)] = self.codec.collect(launched)
                out.append(pcm[id(launched)][row])
            return out
        if any(launches):  # a launch holds some of these slots: their state moved already
            raise RuntimeError("codec launched for part of a step's frames")
        return list(self.codec.step(slots, codes))

    def _audio(self, early: StepOutput, step: "_StepAudio") -> None:
        """Frames whose codes are final -> ONE batched codec step -> each stream's audio. A
        stream never ends here (the engine may still be stepping it): ends come after `run`."""
        now = time.monotonic()
        if step.t_engine is None:
            step.t_engine = now
        good = []
        for result in early.frames:
            step.reported.add(result.slot)
            if result.error is None:
                good.append((self._active[result.slot], result))
        self.frames_generated += len(good)
        self.engine_metrics.frames.inc(len(good))
        if not good:
            return
        try:
            with self._codec_stream():
                pcm = self._decode_audio(step, [s.slot for s, _ in good], np.stack([r.codes for _, r in good]))
        except Exception as e:  # noqa: BLE001
            if self._fault(e, "the codec"):
                return
            log.exception("codec step failed for %d streams", len(good))
            for stream, _ in good:
                step.errors[stream.slot] = StreamFailure(f"codec decode: {e}")
            return
        step.t_codec = time.monotonic()
        prepare_s = step.t_run - step.t0  # this step's prompt preparation, before the engine call
        for stream in step.admitted:
            stream.timings.update(prefill_ms=(prepare_s + early.prefill_s) * 1e3, prepare_ms=prepare_s * 1e3,
                                  first_frame_ms=(now - step.t_run) * 1e3 - early.prefill_s * 1e3,
                                  first_decode_ms=(step.t_codec - now) * 1e3, ready_at=step.t_codec)
        for (stream, result), audio in zip(good, pcm):
            stream.num_frames += 1
            if stream.handle.track is not None:
                self.texts.after_frame(stream)
            self._add_audio(stream, audio, last=stream.num_frames >= stream.max_frames)

    def _add_audio(self, stream: Stream, audio: np.ndarray, last: bool) -> None:
        """One frame of 24 kHz audio (or, empty, the end of a stream's audio): resample it on its
        own (so chunking never changes the samples), then post a chunk when the scheduler says
        one is due."""
        samples = stream.resample(audio, last=last)
        if samples.size:
            stream.pending.append(samples)
        stream.pending_frames += 1 if audio.size else 0
        now = time.monotonic()
        if not stream.pending or not (last or stream.text_dry() or self.scheduler.chunk_due(stream, now)):
            return
        samples = stream.take_audio()
        num_frames, stream.pending_frames = stream.pending_frames, 0
        stream.frames_emitted += num_frames
        stream.handle.post(AudioChunk(samples=samples, sample_offset=stream.num_samples,
                                      num_frames=num_frames, sequence_number=stream.num_chunks,
                                      timings=stream.timings if stream.num_chunks == 0 else None))
        if stream.first_chunk_at is None:
            stream.first_chunk_at = now
        stream.num_samples += samples.shape[0]
        stream.num_chunks += 1
