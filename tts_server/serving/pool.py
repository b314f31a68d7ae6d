"""Several engines in one server (`--devices`): one engine Worker per device behind the one
interface the rpc layer uses (submit, metrics, failure, fatal listeners, stop).

Admission goes to the least-loaded live engine that has a free slot (else to the least-loaded
one whose queue has room). An engine that fails ends only its own streams (UNAVAILABLE: the
client retries) and takes only its own slots away; the pool fails, and the server turns
NOT_SERVING and exits for its supervisor, only when no engine is left.
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

from ..api import EngineFailure, Overloaded, ShuttingDown
from .streams import StreamHandle

log = logging.getLogger(__name__)


def admission_order(loads: Sequence[tuple[int, int, bool]]) -> list[int]:
    """Indices of the engines to offer a request to, best first. `loads[i]` is engine i's
    (outstanding streams: active + queued, slots, alive). Dead engines are left out; engines
    with a free slot come first, then by load (outstanding per slot), then by index."""
    live = [i for i, (_, _, alive) in enumerate(loads) if alive]
    return sorted(live, key=lambda i: (loads[i][0] >= loads[i][1], loads[i][0] / loads[i][1],
                                       loads[i][0], i))


class EnginePool:
    """Routes requests across several started-together Workers (one per device)."""

    def __init__(self, workers: Sequence):
        if len(workers) < 2:
            raise ValueError("an EnginePool needs at least two engines; use the Worker itself")
        self.workers = list(workers)
        self.metrics = self.workers[0].metrics  # the server's one registry, shared
        self.failure: EngineFailure | None = None  # set once no engine is left
        self._fatal_listeners: list = []
        self._lock = threading.Lock()
        for w in self.workers:
            w.add_fatal_listener(lambda failure, w=w: self._on_engine_failure(w, failure))

    # ---- the Worker interface the rpc layer and the app use ---------------------------
    def start(self) -> None:
        for w in self.workers:
            w.start()

    def stop(self, timeout: float | None = None) -> None:
        for w in self.workers:
            w.stop(timeout)

    def add_fatal_listener(self, fn) -> None:
        """fn(EngineFailure) is called once, when the last live engine has failed."""
        self._fatal_listeners.append(fn)

    @property
    def live_workers(self) -> list:
        return [w for w in self.workers if w.failure is None]

    @property
    def max_streams(self) -> int:
        """Slots of the engines still alive."""
        return sum(w.max_streams for w in self.live_workers)

    @property
    def num_outstanding(self) -> int:
        return sum(w.num_outstanding for w in self.workers)

    @property
    def num_active(self) -> int:
        return sum(w.num_active for w in self.workers)

    @property
    def num_paused(self) -> int:
        return sum(w.num_paused for w in self.workers)

    @property
    def num_free_slots(self) -> int:
        return sum(w.num_free_slots for w in self.live_workers)

    @property
    def watchdog_tick(self):
        return self.workers[0].watchdog_tick

    @watchdog_tick.setter
    def watchdog_tick(self, fn) -> None:
        for w in self.workers:  # any live engine's watchdog re-arms the process backstop
            w.watchdog_tick = fn

    def submit(self, request, loop):
        """The request's StreamHandle on the best engine that takes it; the pool's own
        Overloaded / ShuttingDown / EngineFailure when none does."""
        return self.enqueue(StreamHandle(request, loop, None))

    def enqueue(self, handle: StreamHandle) -> StreamHandle:
        """submit() for a handle made by the caller (Worker.enqueue)."""
        loads = [(w.num_outstanding, w.max_streams, w.failure is None) for w in self.workers]
        refused = []
        for i in admission_order(loads):
            try:
                return self.workers[i].enqueue(handle)
            except (Overloaded, ShuttingDown, EngineFailure) as e:  # full, or it died just now
                refused.append(e)
        if any(isinstance(e, ShuttingDown) for e in refused):
            raise ShuttingDown("server is shutting down")
        if not any(isinstance(e, Overloaded) for e in refused):
            why = self.failure or (refused[-1] if refused else "no engine left")
            raise EngineFailure(f"every decode engine has failed ({why}); restarting")
        live = self.live_workers
        raise Overloaded(f"all {sum(w.max_streams for w in live)} synthesis streams on "
                         f"{len(live)} engines are busy and their queues are full")

    # ---- engine threads ---------------------------------------------------------------
    def _on_engine_failure(self, worker, failure: EngineFailure) -> None:
        with self._lock:
            left = self.live_workers
            log.critical("engine on %s failed (%s): its streams ended UNAVAILABLE; %d of %d "
                         "engines left (%s)", worker.label, failure, len(left), len(self.workers),
                         ", ".join(w.label for w in left) or "none")
            if left or self.failure is not None:
                return
            self.failure = EngineFailure(f"every decode engine has failed; the last: {failure}")
        for fn in self._fatal_listeners:
            try:
                fn(self.failure)
            except Exception:  # noqa: BLE001
                log.exception("fatal listener failed")
