"""The scheduler is pure policy: driven here with fake handles and a fake clock, no torch, no engine."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from types import SimpleNamespace

from tts_server.serving.scheduler import PrefillCost, Scheduler, SchedulerConfig, StepCost
from tts_server.serving.streams import Stream

FRAME = 0.08


class FakeHandle:
    def __init__(self, submitted_at=0.0, backlog=0.0, rate=24000):
        self.submitted_at = submitted_at
        self.cancelled = False
        self.paused = False
        self.request = SimpleNamespace(request_id="r", output_sample_rate=rate)
        self._backlog = backlog
        self.ready = True  # False: a StreamSynthesize context without its first token yet
        self.track = None  # a StreamSynthesize context's text track (is_dry)

    def backlog_s(self):
        return self._backlog


def make(max_streams=4, **kw):
    kw.setdefault("preroll_s", 0.0)
    return Scheduler(SchedulerConfig(max_streams=max_streams, frame_s=FRAME, **kw))


def per(seconds, base=0.0):
    """A prefill cost model: base + seconds per admission."""
    return lambda n: base + seconds * n


def running(sch, now, lead_s, slot=None):
    """An active stream whose player (started at its first chunk) has `lead_s` of audio left."""
    slot = sch.take_slot() if slot is None else slot
    s = Stream(handle=FakeHandle(), slot=slot, max_frames=100, resample=None)
    s.frames_emitted = 50
    s.first_chunk_at = now - (50 * FRAME - lead_s)
    sch.add(s)
    return s


def test_scheduler_imports_no_torch():
    code = "import sys, tts_server.serving.scheduler; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_idle_server_admits_everything_that_fits():
    sch = make(max_streams=4)
    sch.waiting.extend(FakeHandle() for _ in range(6))
    plan = sch.plan(now=0.0, prefill_cost=per(0.005), step_s=0.01)
    assert len(plan.admit) == 4 and len(sch.waiting) == 2 and not sch.free_slots
    assert sorted(slot for _, slot in plan.admit) == [0, 1, 2, 3]


def test_admissions_are_budgeted_against_the_most_urgent_stream():
    sch = make(max_streams=64, margin_s=0.0)
    running(sch, now=10.0, lead_s=0.5)
    running(sch, now=10.0, lead_s=0.1)  # the most urgent: 100 ms of audio left
    sch.waiting.extend(FakeHandle(submitted_at=10.0) for _ in range(40))
    # 100 ms lead - 20 ms step = 80 ms of room for prefills of 10 ms each
    assert sch.admission_budget(10.0, per(0.01), step_s=0.02) == 8
    # batched prefill: 30 ms for the batch plus 1 ms each leaves room for 50
    assert sch.admission_budget(10.0, per(0.001, base=0.03), step_s=0.02) == min(40, 50)
    # no room at all: nobody is admitted (a running stream would underrun)
    assert sch.admission_budget(10.0, per(0.2), step_s=0.02) == 0


def test_at_least_one_admission_when_no_stream_is_at_risk():
    sch = make(max_streams=8)
    running(sch, now=5.0, lead_s=2.0)
    sch.waiting.append(FakeHandle())
    assert sch.admission_budget(5.0, per(0.5), step_s=0.02) == 1


def test_streams_without_audio_yet_do_not_block_admissions():
    sch = make(max_streams=8)
    s = Stream(handle=FakeHandle(), slot=sch.take_slot(), max_frames=10, resample=None)
    sch.add(s)  # admitted, no chunk yet: no player to starve
    sch.waiting.extend(FakeHandle() for _ in range(3))
    assert sch.admission_budget(0.0, per(0.01), step_s=0.01) == 3


def test_paused_streams_do_not_step_and_do_not_count_as_urgent():
    sch = make(max_streams=4, max_buffer_s=1.0)
    fast = running(sch, now=0.0, lead_s=0.05)
    fast.handle._backlog = 5.0  # client stopped reading: paused
    slow = running(sch, now=0.0, lead_s=3.0)
    assert [s.slot for s in sch.runnable()] == [slow.slot] and fast.handle.paused
    sch.waiting.append(FakeHandle())
    assert sch.admission_budget(0.0, per(0.01), step_s=0.01) == 1


def test_expired_queue_entries_and_cancellations():
    sch = make(max_streams=1, max_queue_wait_s=2.0)
    old, cancelled, fresh = FakeHandle(0.0), FakeHandle(1.0), FakeHandle(2.5)
    cancelled.cancelled = True
    sch.waiting.extend([old, cancelled, fresh])
    gone = running(sch, now=3.0, lead_s=1.0)
    gone.handle.cancelled = True
    c, too_long, active = sch.expired(now=3.0)
    assert c == [cancelled] and too_long == [old] and active == [gone]
    assert list(sch.waiting) == [fresh]
    sch.release(gone.slot)
    assert sch.free_slots == [0] and not sch.active


def test_chunk_schedule_then_early_when_the_player_runs_low():
    sch = make(chunk_frames=(1, 2, 4), min_lead_s=0.2)
    s = Stream(handle=FakeHandle(), slot=0, max_frames=100, resample=None)
    s.pending_frames = 1
    assert sch.chunk_due(s, now=0.0)  # first chunk: one frame
    s.num_chunks, s.frames_emitted, s.first_chunk_at = 1, 1, 0.0
    s.pending_frames = 1
    assert sch.chunk_due(s, now=0.0)  # player has 80 ms left < 200 ms: at once
    s.frames_emitted = 20  # 1.6 s ahead
    assert not sch.chunk_due(s, now=0.0)
    s.pending_frames = 2
    assert sch.chunk_due(s, now=0.0)  # the schedule's second size
    s.num_chunks, s.pending_frames = 5, 3
    assert not sch.chunk_due(s, now=0.0)  # later chunks: 4 frames
    assert sch.chunk_due(s, now=1.5)  # ...unless the player is about to run dry


def test_the_assumed_player_preroll_counts_as_lead():
    sch = make(max_streams=64, margin_s=0.0, preroll_s=0.2)
    running(sch, now=1.0, lead_s=0.0)  # its player would be dry now without a pre-roll
    sch.waiting.extend(FakeHandle() for _ in range(40))
    assert sch.admission_budget(1.0, per(0.01), step_s=0.02) == 18  # (0.2 - 0.02) / 0.01


def test_admissions_pay_for_the_bigger_step_they_make():
    """With a step cost that grows with its streams, admitting n also makes the step itself
    longer: the budget counts step(running + n), not the step as it was."""
    sch = make(max_streams=64, margin_s=0.0, preroll_s=0.2)
    running(sch, now=1.0, lead_s=0.0)
    sch.waiting.extend(FakeHandle() for _ in range(40))
    flat = sch.admission_budget(1.0, per(0.005), step_s=0.02)
    step = StepCost(base_s=0.02, each_s=0.002)  # 1 running stream: 22 ms; +2 ms per new one
    growing = sch.admission_budget(1.0, per(0.005), step_s=step)
    assert flat == 36  # (0.2 - 0.02) / 0.005
    assert growing == 25  # 0.005 n + 0.02 + 0.002 (1 + n) <= 0.2
    assert step(1 + growing) + 0.005 * growing <= 0.2 < step(2 + growing) + 0.005 * (growing + 1)


def test_step_cost_learns_its_growth_with_streams():
    cost = StepCost()
    for b in (1, 8, 64, 128, 256, 32):
        cost.observe(b, 0.010 + 0.0001 * b)
    assert abs(cost(200) - 0.030) < 1e-9


def test_prefill_cost_fits_a_fixed_and_a_per_admission_part():
    cost = PrefillCost()
    for n in (1, 4, 16, 64, 2, 32):
        cost.observe(n, 0.030 + 0.0005 * n)
    assert abs(cost.base_s - 0.030) < 1e-9 and abs(cost.each_s - 0.0005) < 1e-9
    assert abs(cost(100) - 0.080) < 1e-9
    one = PrefillCost()
    one.observe(10, 0.02)  # a single batch size: half fixed, half per admission
    assert abs(one(10) - 0.02) < 1e-12 and abs(one.base_s - 0.01) < 1e-12


def test_a_saturated_server_still_admits_one_request_a_step_before_the_queue_times_out():
    sch = make(max_streams=8, margin_s=0.0, max_queue_wait_s=4.0)
    running(sch, now=10.0, lead_s=0.0)  # its player is dry: no room for any prefill
    sch.waiting.extend([FakeHandle(submitted_at=9.0), FakeHandle(submitted_at=9.5)])
    assert sch.admission_budget(10.0, per(0.01), step_s=0.05) == 0  # waited 1 s of 4
    assert sch.admission_budget(11.5, per(0.01), step_s=0.05) == 1  # waited 2.5 s: one a step


class DryTrack:
    """A text track that has vectors for frames < `have` (then the stream waits for text)."""

    def __init__(self, have):
        self.have = have

    def is_dry(self, num_frames):
        return num_frames >= self.have


def test_contexts_without_text_neither_block_the_queue_nor_time_out():
    sch = make(max_streams=2, max_queue_wait_s=1.0)
    waiting, ready = FakeHandle(submitted_at=0.0), FakeHandle(submitted_at=0.5)
    waiting.ready = False
    sch.waiting.extend([waiting, ready])
    c, too_long, _ = sch.expired(now=0.9)
    assert not c and not too_long
    plan = sch.plan(0.9, per(0.01), step_s=0.01)
    assert [h for h, _ in plan.admit] == [ready] and list(sch.waiting) == [waiting]
    assert sch.expired(now=60.0)[1] == []  # no first token yet: the idle timeout applies, not this
    assert sch.wait_timeout(60.0) == 0.05  # ...so the loop keeps looking


def test_a_stream_whose_text_ran_dry_holds_its_slot_but_is_not_stepped():
    sch = make(max_streams=2, margin_s=0.0)
    dry = running(sch, now=10.0, lead_s=-5.0)  # its player ran dry while its text did
    dry.handle.track = DryTrack(have=0)
    live = running(sch, now=10.0, lead_s=1.0)
    live.handle.track = DryTrack(have=10**6)
    assert sch.runnable() == [live] and dry.slot in sch.active and not sch.free_slots
    sch.release(live.slot)
    sch.waiting.append(FakeHandle(submitted_at=10.0))
    # the dry stream's lead does not hold back admissions (no prefill work could help it)
    assert sch.admission_budget(10.0, per(0.01), step_s=0.01) == 1
    dry.handle.track.have = 10**6
    assert sch.runnable() == [dry]


def young(sch, now, frames, age_s):
    """A running stream whose first chunk went out `age_s` ago, `frames` frames posted since."""
    s = Stream(handle=FakeHandle(), slot=sch.take_slot(), max_frames=100, resample=None)
    s.frames_emitted, s.first_chunk_at = frames, now - age_s
    sch.add(s)
    return s


def test_pre_rolling_streams_with_time_to_spare_leave_an_admission_step_out():
    sch = make(max_streams=16, margin_s=0.04, preroll_s=0.2)
    spare = young(sch, now=1.0, frames=2, age_s=0.05)  # 110 ms ahead, player starts in 150 ms
    tight = young(sch, now=1.0, frames=1, age_s=0.15)  # starts in 50 ms, dry 80 ms later: 130 ms
    playing = running(sch, now=1.0, lead_s=3.0)  # far ahead, but its player is playing
    fresh = Stream(handle=FakeHandle(), slot=sch.take_slot(), max_frames=100, resample=None)
    sch.add(fresh)  # no first chunk yet
    sch.waiting.extend(FakeHandle(submitted_at=1.0) for _ in range(4))
    step = StepCost(base_s=0.02, each_s=0.0)
    sch.cfg = dataclasses.replace(sch.cfg, sit_out_min_admit=4)
    plan = sch.plan(1.0, per(0.01), step_s=step)  # this step ~60 ms, the next 20: 1.5 x 80 = 120 ms
    assert len(plan.admit) == 4 and plan.sat_out == 1
    assert {s.slot for s in plan.step} == {tight.slot, playing.slot, fresh.slot}
    assert spare.slot not in {s.slot for s in plan.step}
    # without admissions every runnable stream steps
    plan = sch.plan(1.0, per(0.01), step_s=step)
    assert not plan.admit and plan.sat_out == 0 and len(plan.step) == 4
    # ...and in a step admitting fewer than sit_out_min_admit (steady traffic, not a burst)
    sch.waiting.extend(FakeHandle(submitted_at=1.0) for _ in range(3))
    plan = sch.plan(1.0, per(0.001), step_s=step)
    assert len(plan.admit) == 3 and plan.sat_out == 0 and len(plan.step) == 4


def test_sit_outs_can_be_turned_off():
    for on in (True, False):  # TTS_SIT_OUT=0
        sch = make(max_streams=8, preroll_s=0.2, sit_out=on, sit_out_min_admit=1)
        young(sch, now=1.0, frames=3, age_s=0.01)
        sch.waiting.append(FakeHandle(submitted_at=1.0))
        plan = sch.plan(1.0, per(0.001), step_s=0.001)
        assert len(plan.admit) == 1 and plan.sat_out == int(on) and len(plan.step) == 1 - int(on)


def simulate_burst(sit_out: bool, n=256, per_ms=3.2, preroll_s=0.2):
    """A fake-clock burst: `n` requests arrive at `per_ms` a millisecond; a step costs
    2 ms + 0.28 ms per admission plus 4 ms + 0.07 ms per stream it makes a frame for (about an
    H100's). Returns (each request's first audio - arrival, s; the smallest audio any player had
    left at any step's end, s; the number of steps)."""
    sch = make(max_streams=n, preroll_s=preroll_s, sit_out=sit_out)
    prefill = per(0.00028, base=0.002)
    step = StepCost(base_s=0.004, each_s=0.00007)
    arrivals = [i / (per_ms * 1e3) for i in range(n)]
    handles = [FakeHandle(submitted_at=t) for t in arrivals]
    first_audio, worst, now, nxt, steps, streams = {}, float("inf"), 0.0, 0, 0, []
    while len(first_audio) < n:
        while nxt < n and arrivals[nxt] <= now:
            sch.waiting.append(handles[nxt])
            nxt += 1
        plan = sch.plan(now, prefill, step)
        if not plan.admit and not plan.step:
            now = arrivals[nxt]
            continue
        steps += 1
        now += (prefill(len(plan.admit)) if plan.admit else 0.0) + step(len(plan.step) + len(plan.admit))
        made = list(plan.step)
        for h, slot in plan.admit:
            s = Stream(handle=h, slot=slot, max_frames=1000, resample=None)
            sch.add(s)
            streams.append(s)
            made.append(s)
        for s in made:  # one frame each; chunks on the scheduler's schedule
            s.pending_frames += 1
            if sch.chunk_due(s, now):
                s.frames_emitted += s.pending_frames
                s.pending_frames, s.num_chunks = 0, s.num_chunks + 1
                if s.first_chunk_at is None:
                    s.first_chunk_at = now
                    first_audio[id(s.handle)] = now - s.handle.submitted_at
        worst = min([worst] + [s.lead_s(now, FRAME) + preroll_s for s in streams if s.first_chunk_at is not None])
    return sorted(first_audio.values()), worst, steps


def test_in_a_burst_sit_outs_bring_the_last_first_audio_forward_and_no_player_runs_dry():
    base, base_worst, _ = simulate_burst(sit_out=False)
    new, new_worst, _ = simulate_burst(sit_out=True)
    p95 = lambda xs: xs[int(0.95 * (len(xs) - 1))]  # noqa: E731
    assert new_worst > 0.04 and base_worst > 0.04  # every player kept audio (200 ms pre-roll)
    assert p95(new) < p95(base) - 0.01 and new[-1] < base[-1] - 0.01, (p95(base), p95(new))


def test_no_sit_outs_for_players_without_pre_roll():
    """--player-preroll-ms 0 (a player that plays the first byte at once): nobody sits out."""
    sch = make(max_streams=64, preroll_s=0.0)
    for _ in range(8):
        young(sch, now=1.0, frames=10, age_s=0.0)  # 800 ms ahead, first chunk just out
    sch.waiting.extend(FakeHandle(submitted_at=1.0) for _ in range(20))
    plan = sch.plan(1.0, per(0.0001), step_s=0.001)
    assert len(plan.admit) == 20 and plan.sat_out == 0 and len(plan.step) == 8
    sch2 = make(max_streams=64, preroll_s=0.2)  # the same with the default pre-roll: they sit out
    for _ in range(8):
        young(sch2, now=1.0, frames=10, age_s=0.0)
    sch2.waiting.extend(FakeHandle(submitted_at=1.0) for _ in range(20))
    assert sch2.plan(1.0, per(0.0001), step_s=0.001).sat_out == 8
