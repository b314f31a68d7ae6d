"""Scheduling policy, pure Python (no torch): which waiting requests are admitted this step, which
active streams step, when a stream's audio goes out as a chunk.

Every active stream whose client keeps up advances one frame per step (the engine batches them);
admissions are budgeted against the running streams' playback deadlines, so that the prefill work
added to a step never makes a running stream's player run dry.

StreamSynthesize contexts wait for text: one is admitted once its first token is there (`ready`),
and an active one whose text track has run dry holds its slot but is not stepped (no frames, no
GPU work) until more text or its end arrives.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

from .streams import Stream, StreamHandle


@dataclass(frozen=True)
class SchedulerConfig:
    max_streams: int  # engine slots
    frame_s: float = 0.08  # audio per frame
    chunk_frames: tuple[int, ...] = (1, 2, 4, 8)  # frames per chunk: the first ones small
    max_queue_wait_s: float = 5.0  # a request waiting longer for a slot is refused
    max_buffer_s: float = 10.0  # a stream this far ahead of its client pauses
    min_lead_s: float = 0.2  # a stream with less audio ahead of its player gets every frame at once
    margin_s: float = 0.04  # kept free of prefill work below the most urgent stream's deadline
    preroll_s: float = 0.2  # audio a player buffers before it starts playing (--player-preroll-ms)
    max_admit_per_step: int = 256
    # a step that admits requests leaves out running streams whose players are still pre-rolling
    # with time to spare (see `sit_outs`), so that the admitted ones' first frames come sooner
    sit_out: bool = True
    sit_out_safety: float = 1.5  # the spare a stream leaving a step out keeps: this x the two steps' cost
    sit_out_min_admit: int = 16  # ...in steps admitting at least this many (a burst)


@dataclass
class Plan:
    """What the loop runs next: requests to admit (with their slots) and streams to step."""

    admit: list[tuple[StreamHandle, int]]
    step: list[Stream]
    sat_out: int = 0  # runnable streams left out of this step for its admissions (`sit_outs`)


class Scheduler:
    """Owns the waiting queue, the active streams and the free slots; the loop asks it what to run."""

    def __init__(self, config: SchedulerConfig):
        self.cfg = config
        self.waiting: collections.deque[StreamHandle] = collections.deque()
        self.active: dict[int, Stream] = {}
        self.free_slots = list(range(config.max_streams))[::-1]

    # ---- queue and slots ------------------------------------------------------------------
    def expired(self, now: float) -> tuple[list[StreamHandle], list[StreamHandle], list[Stream]]:
        """Remove and return (cancelled waiting, waited too long, cancelled active) streams."""
        cancelled = [h for h in self.waiting if h.cancelled]
        too_long = [h for h in self.waiting
                    if h.ready and not h.cancelled and now - h.submitted_at > self.cfg.max_queue_wait_s]
        for h in cancelled + too_long:
            self.waiting.remove(h)
        gone = [s for s in self.active.values() if s.handle.cancelled]
        return cancelled, too_long, gone

    def take_slot(self) -> int:
        return self.free_slots.pop()

    def add(self, stream: Stream) -> None:
        self.active[stream.slot] = stream

    def release(self, slot: int) -> None:
        """The slot's stream has ended (or its admission failed): the slot is free again."""
        self.active.pop(slot, None)
        if slot not in self.free_slots:
            self.free_slots.append(slot)

    # ---- one step -------------------------------------------------------------------------
    def ready(self) -> list[StreamHandle]:
        """Waiting requests that can be admitted now (a StreamSynthesize context needs text)."""
        return [h for h in self.waiting if h.ready]

    def runnable(self) -> list[Stream]:
        """Active streams whose client keeps up (the others pause until it reads) and whose text
        track has its next vector (the others wait for text)."""
        out = []
        for stream in self.active.values():
            h = stream.handle
            h.paused = h.backlog_s() > self.cfg.max_buffer_s
            if not h.paused and not stream.text_dry():
                out.append(stream)
        return out

    def admission_budget(self, now: float, prefill_cost, step_s) -> int:
        """How many waiting requests this step may admit. Admitting n costs `prefill_cost(n)`
        seconds of engine time (a step's admissions prefill together) on top of the step itself,
        `step_s(b)` seconds for b streams (the running ones plus the n new ones; a number: the
        same for any b); the most urgent running stream's player (assumed to have buffered
        `preroll_s`) must still have audio left when the step ends. At least one admission when
        no running stream is at risk, or when the oldest request has waited half of
        `max_queue_wait_s`, so that a free slot never lets a request time out in the queue."""
        ready = self.ready()
        room = min(len(ready), len(self.free_slots), self.cfg.max_admit_per_step)
        if room == 0:
            return 0
        # a stream waiting for text is not stepped: no cost, and no prefill can help its player
        running = [s for s in self.active.values() if not s.handle.paused and not s.text_dry()]
        lead = min((s.lead_s(now, self.cfg.frame_s) for s in running), default=math.inf)
        spare = lead + self.cfg.preroll_s - self.cfg.margin_s + 1e-9  # rounding
        if math.isinf(spare):
            return room
        step = _per_streams(step_s)
        cost = lambda n: prefill_cost(n) + step(len(running) + n)  # noqa: E731
        if spare < cost(1):
            # a server that cannot protect its running streams still serves its queue: one
            # admission a step once the oldest request has waited half its allowed time
            starving = now - ready[0].submitted_at > self.cfg.max_queue_wait_s / 2
            return 1 if starving else 0
        lo, hi = 1, room  # the largest n with cost(n) <= spare (cost grows with n)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if cost(mid) <= spare else (lo, mid - 1)
        return lo

    def plan(self, now: float, prefill_cost, step_s) -> Plan:
        """Admissions (popped from the queue, each with a free slot) and the streams to step."""
        n = self.admission_budget(now, prefill_cost, step_s)
        admit = [(h, self.take_slot()) for h in (self.ready()[:n] if n else ())]
        for h, _ in admit:
            self.waiting.remove(h)
        step = self.runnable()
        out = self.sit_outs(step, len(admit), now, prefill_cost, step_s) if admit else set()
        return Plan(admit=admit, step=[s for s in step if s.slot not in out], sat_out=len(out))

    def sit_outs(self, runnable: list[Stream], num_admit: int, now: float, prefill_cost, step_s) -> set[int]:
        """The slots of running streams that can leave out a step admitting `num_admit` requests.

        In a burst of new calls, every running stream is young, and each admission step also
        makes a frame for all of them: 100+ streams' frames and codec steps in front of the new
        ones' first audio. A stream whose player is still pre-rolling (its first chunk less than
        `preroll_s` ago: the player plays nothing yet) and has more than `sit_out_safety` x
        (this step + the next one) of audio to spare can skip this step. Its player loses
        nothing it needs, its audio is the same (frames never depend on when they are made), and
        it is considered again at the next step. A stream without a first chunk never sits out
        (its first audio is what it waits for), nor one whose player is playing: those keep
        their whole lead for hiccups.

        Only in a burst (`sit_out_min_admit` admissions or more in the step): in open-loop
        traffic (20 and 60 requests/s on an H100: 1-6 admissions a step) leaving young streams
        out did not bring first audio forward measurably, and at 60 requests/s it left 6% of the
        streams with a gap for a player that starts at once (no pre-roll)."""
        cfg = self.cfg
        if not cfg.sit_out or not runnable or num_admit < cfg.sit_out_min_admit:
            return set()
        step = _per_streams(step_s)
        this = prefill_cost(num_admit) + step(len(runnable) + num_admit)  # an upper bound: all step
        need = cfg.sit_out_safety * (this + step(len(runnable) + num_admit))
        return {s.slot for s in runnable
                if s.first_chunk_at is not None and now - s.first_chunk_at < cfg.preroll_s
                and s.lead_s(now, cfg.frame_s) + cfg.preroll_s - cfg.margin_s > need}

    # ---- chunking -------------------------------------------------------------------------
    def chunk_due(self, stream: Stream, now: float) -> bool:
        """A chunk goes out when it has its scheduled size (small first: 1, 2, 4, then 8 frames),
        or at once when the stream's player has less than `min_lead_s` of audio left. The audio
        itself never depends on this: every frame is decoded (and resampled) on its own."""
        if stream.pending_frames == 0:
            return False
        schedule = self.cfg.chunk_frames
        if stream.pending_frames >= schedule[min(stream.num_chunks, len(schedule) - 1)]:
            return True
        return stream.lead_s(now, self.cfg.frame_s) < self.cfg.min_lead_s

    def wait_timeout(self, now: float) -> float | None:
        """How long the loop may sleep with nothing runnable (None: until woken)."""
        timeouts = []
        ready = self.ready()
        if ready:
            oldest = ready[0].submitted_at
            timeouts.append(max(0.0, oldest + self.cfg.max_queue_wait_s - now) + 1e-3)
        if self.active or len(ready) < len(self.waiting):
            # paused streams (look again soon even if no chunk is acknowledged); contexts waiting
            # for text (idle timeouts)
            timeouts.append(0.05)
        return min(timeouts) if timeouts else None


def _per_streams(step_s):
    """A step-cost argument as a function of the stream count (a number: the same for any)."""
    return step_s if callable(step_s) else (lambda b: step_s)


@dataclass
class LinearCost:
    """Seconds as a function of a count, t = base + each * n, fitted by least squares to the
    last `window` observations."""

    base_s: float = 0.005
    each_s: float = 0.001
    window: int = 32
    _obs: collections.deque = field(default_factory=collections.deque)

    def __call__(self, n: int) -> float:
        return self.base_s + self.each_s * n

    def observe(self, n: int, seconds: float) -> None:
        self._obs.append((n, seconds))
        while len(self._obs) > self.window:
            self._obs.popleft()
        xs, ts = [o[0] for o in self._obs], [o[1] for o in self._obs]
        mx, mt = sum(xs) / len(xs), sum(ts) / len(ts)
        var = sum((x - mx) ** 2 for x in xs)
        if var > 0:
            each = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / var
            self.each_s = max(each, 1e-5)
            self.base_s = max(mt - self.each_s * mx, 0.0)
        else:  # one batch size seen so far: split the cost evenly between the two terms
            self.base_s, self.each_s = mt / 2, max(mt / 2 / mx, 1e-5)


@dataclass
class PrefillCost(LinearCost):
    """A step's admissions for n requests (prefills run batched, so n admissions cost far less
    than n single ones)."""


@dataclass
class StepCost(LinearCost):
    """A step without its admissions for b streams (engine frame, codec, chunking: all grow with
    b), so that the admissions' budget counts the step they make bigger."""

    base_s: float = 0.005
    each_s: float = 0.0002
    window: int = 64
