"""Fault injection for the hardening tests (`--inject-fault`, never on in normal serving).

A spec is `KIND:REQUEST_ID[@FRAME]` (several joined by commas); the fault fires when the named
request's stream takes its FRAME-th step (default 1):

  stream_error   the engine returns an error for that stream's slot only (as a non-finite
                 logits check does); the other streams in the step are unaffected
  device_error   the whole step raises a CUDA-style error (the engine is unusable afterwards)
  hang           the step never returns (a hung kernel); only the watchdog gets the process out
  eos            the talker draws EOS in that step: the frame is the stream's last (an engine
                 with early codes has already handed its codes over, as with a real EOS)

The real engine runs underneath for every step that does not hang or raise.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

from ..engines.contract import StepOutput, StepPlan

KINDS = ("stream_error", "device_error", "hang", "eos")


@dataclass(frozen=True)
class Fault:
    kind: str
    request_id: str
    frame: int = 1


def parse_faults(spec: str) -> list[Fault]:
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, sep, target = part.partition(":")
        if kind not in KINDS or not sep or not target:
            raise ValueError(f"bad fault {part!r}: expected KIND:REQUEST_ID[@FRAME], KIND one of "
                             f"{', '.join(KINDS)}")
        rid, _, frame = target.partition("@")
        faults.append(Fault(kind, rid, int(frame) if frame else 1))
    return faults


class FaultInjectingEngine:
    """Wraps a decode engine; the worker tells it which request holds which slot."""

    def __init__(self, engine, spec: str):
        self.inner = engine
        self.faults = {f.request_id: f for f in parse_faults(spec)}
        self.name = engine.name
        self.max_streams = engine.max_streams
        self.max_positions = engine.max_positions
        self._owner: dict[int, str] = {}
        self._steps: dict[int, int] = {}
        self.released = threading.Event()  # set to let a hung step return (tests only)
        # an engine that hands over device codes (on_launch) keeps doing so under the faults
        self.launches_codes = bool(getattr(engine, "launches_codes", False))

    def bind_request(self, slot: int, request_id: str) -> None:
        self._owner[slot] = request_id
        self._steps[slot] = 0

    def release(self, slot: int) -> None:
        self._owner.pop(slot, None)
        self._steps.pop(slot, None)
        self.inner.release(slot)

    def extend_text(self, slot: int, vectors, eos_from: int | None = None) -> None:
        self.inner.extend_text(slot, vectors, eos_from)

    def _due(self, slots: Sequence[int]) -> dict[int, Fault]:
        due = {}
        for slot in slots:
            self._steps[slot] = self._steps.get(slot, 0) + 1
            fault = self.faults.get(self._owner.get(slot, ""))
            if fault is not None and self._steps[slot] == fault.frame:
                due[slot] = fault
        return due

    def run(self, plan: StepPlan, on_codes=None, on_launch=None) -> StepOutput:
        due = self._due(plan.decode)
        kinds = {f.kind for f in due.values()}
        if "hang" in kinds:
            self.released.wait()
        if "device_error" in kinds:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        # an injected stream error lands after the codes, as a talker one
        out = self.inner.run(plan, on_codes, on_launch) if self.launches_codes else self.inner.run(plan, on_codes)
        for r in out.frames:
            if r.slot in due and due[r.slot].kind == "stream_error":
                r.error = "non-finite talker logits (injected)"
            elif r.slot in due and due[r.slot].kind == "eos":
                r.next_is_eos = True
        return out
