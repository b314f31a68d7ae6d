"""The step contract between the serving loop and a decode engine.

An engine owns fixed per-stream slots (KV storage, positions, sampling state). The serving loop
calls `run(plan)` once per step: the plan admits new streams (prefill: the prompt goes through
the talker into the slot and the first code 0 is sampled) and advances a set of slots by one
80 ms frame each. One call, one host copy of all results. `release` frees a slot. One engine
thread makes every call.

Semantics of a decode for a slot (identical to qwen-tts generate):
  1. the pending code 0 (sampled by the previous talker step or by prefill) and the talker's
     last hidden state go through the 15 code-predictor passes -> codes 1..15 of this frame;
  2. the next talker input is the sum of the 16 codebook embeddings of this frame plus the
     stream's next text-track vector (pending text, then tts_pad forever);
  3. one talker step at the stream's next position -> codec_head logits -> the next code 0,
     sampled with repetition penalty over the code-0 history, EOS masked for the first
     `min_new_tokens` samples, ids in [vocab-1024, vocab) except EOS suppressed.
The text track may grow while the stream runs (`extend_text`, StreamSynthesize): the serving loop
steps a slot only while its next text vector is there (or its track is closed), and `eos_from`
keeps EOS out of the slot's draws until the track is closed and all its text has entered.
The frame's 16 codes are returned with `next_is_eos`: when True the stream has ended after
this frame. Admissions run before the decodes of the same plan, so a slot admitted in a plan
may also be decoded in it (its first frame then comes out of the same call).

Reproducibility: a slot's codes depend only on its own prompt, sampling settings and seed,
never on which other slots share the step (engines are batch-invariant or say otherwise).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..api import SamplingConfig
from ..model.prompt import Prompt

__all__ = ["Admission", "DecodeEngine", "FrameResult", "OPEN_TRACK", "Prompt", "SamplingConfig",
           "StepOutput", "StepPlan", "decode_until_eos", "eos_gate", "run_parts"]

OPEN_TRACK = 2**31 - 1  # eos_from of a stream whose text is still arriving: no EOS yet


def eos_gate(num_sampled: int, eos_from: int) -> int:
    """The draw count the min-new-tokens EOS mask sees: -1 (EOS masked) before draw `eos_from`."""
    return num_sampled if num_sampled >= eos_from else -1


@dataclass(frozen=True)
class Admission:
    """A stream entering `slot`: prefill its prompt and sample its first code 0."""

    slot: int
    prompt: Prompt
    sampling: SamplingConfig
    request_id: str = ""
    # draws are numbered from 0 (prefill); EOS is masked in draws before this one (besides the
    # min_new_tokens rule). A text track of m text vectors then EOS: m, so that EOS can follow
    # the talker step that took the last text vector; OPEN_TRACK while text may still come.
    eos_from: int = 0


@dataclass(frozen=True)
class StepPlan:
    """One engine call: admissions first, then one frame for every slot in `decode`."""

    decode: tuple[int, ...] = ()
    admit: tuple[Admission, ...] = ()


@dataclass
class FrameResult:
    slot: int
    codes: np.ndarray  # [16] int64: code 0 (talker) then codes 1..15 (code predictor)
    next_is_eos: bool  # the talker's next code 0 is EOS: this frame is the stream's last
    error: str | None = None  # this slot failed (the others in the step are valid); codes unused


@dataclass
class StepOutput:
    frames: list[FrameResult] = field(default_factory=list)  # plan.decode order, minus failed admissions
    failed: dict[int, str] = field(default_factory=dict)  # slot -> why its admission failed
    # time spent in admissions: host clock, synchronised (an engine that launches them without
    # waiting, as the batched one does, reports their device time from the step's start)
    prefill_s: float = 0.0
    decode_s: float = 0.0  # the rest of the call: the frame step (and what on_codes did inside it)


class DecodeEngine(Protocol):
    """What the serving loop needs from a decode engine."""

    name: str  # "torch", "megakernel", ...
    max_streams: int  # number of slots
    max_positions: int  # talker positions per slot (prefill + frames)

    def run(self, plan: StepPlan, on_codes=None) -> StepOutput:
        """Run `plan`. A failure confined to one slot comes back in `failed` (admission) or as
        that slot's `FrameResult.error`; an exception means the whole step failed (a device
        fault leaves the engine unusable).

        on_codes(early: StepOutput), optional: an engine that finishes a frame's 16 codes before
        its talker step (which samples the next code 0) may call it, at most once per decoded
        slot, as soon as those codes are on the host, so that the caller can decode audio while
        the talker step runs. `early.frames` then hold final codes, `next_is_eos` False and only
        the code-predictor's errors; `failed` and `prefill_s` are final. The frames that `run`
        returns are complete: a slot may still fail there (talker logits) or end (EOS). Engines
        that cannot report early ignore on_codes.

        An engine whose `launches_codes` is True also takes `on_launch(slots, codes, ready)`:
        called once per group of decoded slots right after their frame is launched, before its
        codes reach the host, with a device view codes [n, 16] (int32, row i = slots[i]) that
        holds the final codes once the device passes `ready` (a CUDA event, or None where the
        codes are already there) and stays valid until that group's on_codes returns. The caller
        may queue device work on it (the codec) meanwhile; on_codes for those slots follows. A
        slot whose frame then reports an error has garbage codes there."""
        ...

    def release(self, slot: int) -> None:
        """Forget `slot`'s stream; the slot may be admitted again."""
        ...

    def extend_text(self, slot: int, vectors, eos_from: int | None = None) -> None:
        """Append text-track vectors [n, H] to `slot`'s pending text; with `eos_from`, replace
        its EOS gate (see Admission). Optional: engines without it serve no StreamSynthesize."""
        ...


def run_parts(engine, plan: StepPlan, groups: list[list[int]]) -> StepOutput:
    """`run` for engines with per-slot `prefill(slot, prompt, sampling)` and batched
    `step(slots)`: admissions one at a time (a failure there fails that slot only, unless it is a
    device fault), then `step` once per group of decode slots."""
    out = StepOutput()
    t0 = time.perf_counter()
    for adm in plan.admit:
        try:
            if adm.eos_from:  # engines without open text tracks take no eos_from
                engine.prefill(adm.slot, adm.prompt, adm.sampling, eos_from=adm.eos_from)
            else:
                engine.prefill(adm.slot, adm.prompt, adm.sampling)
        except (ValueError, RuntimeError) as e:
            if "CUDA" in str(e) or "megakernel" in str(e):
                raise
            engine.release(adm.slot)
            out.failed[adm.slot] = str(e)
    t1 = time.perf_counter()
    for group in groups:
        group = [s for s in group if s not in out.failed]
        if group:
            out.frames.extend(engine.step(group))
    out.prefill_s, out.decode_s = t1 - t0, time.perf_counter() - t1
    return out


def decode_until_eos(engine: DecodeEngine, slot: int, max_frames: int, prompt: Prompt | None = None,
                     sampling: SamplingConfig | None = None) -> np.ndarray:
    """Admit `prompt` into `slot` (when given), then step it alone until EOS or `max_frames`;
    returns its frames [F, 16]."""
    frames = []
    admit = (Admission(slot, prompt, sampling or SamplingConfig()),) if prompt is not None else ()
    for _ in range(max_frames):
        out = engine.run(StepPlan(decode=(slot,), admit=admit))
        admit = ()
        if out.failed:
            raise RuntimeError(out.failed[slot])
        result = out.frames[0]
        if result.error is not None:
            raise RuntimeError(result.error)
        frames.append(result.codes)
        if result.next_is_eos:
            break
    return np.stack(frames)
