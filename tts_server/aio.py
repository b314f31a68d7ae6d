"""How the server processes run: their event loop, and their start-up objects kept out of the
garbage collector. The loop is uvloop where it is installed, else asyncio's; `--event-loop
asyncio` keeps asyncio's. With the servicer and a stand-in engine in one process, uvloop took
~12% less event-loop CPU per call and a 256-call burst's first audio came ~20% sooner (this repo's
2-core machine). On an H100 host (session 21, same-host A/B) a 256-stream burst's first audio
p50 / p95 fell from 193 / 248 to 151 / 223 ms, one stream unchanged (BENCHMARKS.md)."""

from __future__ import annotations

import asyncio
import gc
import time

CHOICES = ("auto", "uvloop", "asyncio")


def _uvloop():
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


def freeze_start_up_objects() -> int:
    """Collect once, then take every object alive now out of the garbage collector's reach
    (gc.freeze), so that no full collection walks what a process loaded before serving: a model,
    tokenizer, engine and codec leave ~500k long-lived objects (a full collection over them took
    ~230 ms with the 0.6B model, seen as 280-360 ms engine steps on the H100), an RPC process's
    imports ~50k (~50 ms on a CI core). What serving allocates afterwards is still collected.
    Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def available(name: str) -> bool:
    """Whether `name` (one of CHOICES) can run here (auto always can)."""
    return name != "uvloop" or _uvloop() is not None


def run(coro, name: str = "auto"):
    """asyncio.run(coro) on the chosen loop: auto is uvloop where installed, else asyncio."""
    uvloop = _uvloop() if name != "asyncio" else None
    if uvloop is not None:
        return uvloop.run(coro)
    if name == "uvloop":
        raise RuntimeError("--event-loop uvloop: uvloop is not installed")
    return asyncio.run(coro)


class StallWatch:
    """Bounds how long a write may wait on a client that reads nothing (HTTP/2 or TCP flow
    control), for all of a server's writes at once: `await watch.run(write)` registers the write,
    and one watcher task, alive only while writes are in flight, cancels every `period_s` those
    older than `limit_s`, whose `run` then raises TimeoutError. So a write may wait up to
    limit_s + period_s. An `asyncio.timeout` around each write arms and cancels a timer per write:
    ~10 us of event-loop time per write on uvloop, several times the rest of this, in a loop
    that a 256-call burst over one connection keeps busy (BENCHMARKS.md, session 30)."""

    def __init__(self, limit_s: float):
        self.limit_s = limit_s
        self.period_s = max(0.01, min(1.0, limit_s / 4))
        self._started: dict[asyncio.Task, float] = {}  # writes in flight: their task -> start
        self._expired: set[asyncio.Task] = set()  # cancelled by the watcher, not yet raised
        self._watcher: asyncio.Task | None = None

    async def run(self, write):
        """Await `write` (an awaitable); TimeoutError once it has waited longer than limit_s."""
        task = asyncio.current_task()
        self._started[task] = time.monotonic()
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())
        try:
            return await write
        except asyncio.CancelledError:
            if task in self._expired:
                self._expired.discard(task)
                if task.uncancel() == 0:  # (else someone else cancelled it too: theirs stands)
                    raise TimeoutError(f"write waited more than {self.limit_s:g} s") from None
            raise
        finally:
            del self._started[task]

    @property
    def in_flight(self) -> int:
        return len(self._started)

    async def _watch(self) -> None:
        try:
            while self._started:
                await asyncio.sleep(self.period_s)
                oldest = time.monotonic() - self.limit_s
                for task, started in list(self._started.items()):
                    if started <= oldest and task not in self._expired:
                        self._expired.add(task)
                        task.cancel()
        finally:
            self._watcher = None
