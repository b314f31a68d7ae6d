"""How the server processes run: their event loop, and their start-up objects kept out of the
garbage collector. The loop is uvloop where it is installed, else asyncio's; `--event-loop
asyncio` keeps asyncio's. With the servicer and a stand-in engine in one process, uvloop took
~12% less event-loop CPU per call and a 256-call burst's first audio came ~20% sooner (this repo's
2-core machine). On an H100 host (session 21, same-host A/B) a 256-stream burst's first audio
p50 / p95 fell from 193 / 248 to 151 / 223 ms, one stream unchanged (BENCHMARKS.md)."""

from __future__ import annotations

import asyncio
import gc

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
