"""Start-up memory plan: what `--max-streams` streams of `--max-positions` need on the device (KV,
slot state, codec state, graph catalogs) against the free memory, decided before allocating."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

GiB = 1024 ** 3
DEFAULT_GPU_STREAMS = 256  # the real-time capacity target per GPU (BENCHMARKS.md has the measurement)


class StartupError(RuntimeError):
    """A configuration the server cannot run; the message is one line for the operator."""


@dataclass(frozen=True)
class MemoryPlan:
    max_streams: int
    need_bytes: int  # for max_streams
    free_bytes: int
    max_fit: int  # the most streams that fit

    def describe(self) -> str:
        return (f"{self.max_streams} streams need {self.need_bytes / GiB:.2f} GiB of device memory "
                f"({self.free_bytes / GiB:.2f} GiB free; up to {self.max_fit} streams fit)")


def plan_streams(need: Callable[[int], int], free_bytes: int, requested: int | None,
                 default: int = DEFAULT_GPU_STREAMS, reserve_bytes: int = 2 * GiB) -> MemoryPlan:
    """`need(n)`: device bytes for n streams (monotonic in n). `requested` None picks
    min(default, what fits). Raises StartupError when the request (or a single stream) does not
    fit in `free_bytes` less `reserve_bytes` (activations, allocator slack, the CUDA context)."""
    budget = free_bytes - reserve_bytes
    lo, hi = 0, max(requested or 0, default, 1)
    while need(hi) <= budget and hi < 1 << 16:  # grow until it no longer fits
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if need(mid) <= budget else (lo, mid)
    max_fit = lo if need(lo) <= budget else 0
    n = requested if requested is not None else min(default, max_fit)
    plan = MemoryPlan(n, need(max(n, 1)), free_bytes, max_fit)
    if max_fit < 1:
        raise StartupError(f"not even one stream fits: {plan.describe()}; lower --max-positions")
    if n > max_fit:
        raise StartupError(f"--max-streams {n} does not fit: {plan.describe()}; use "
                           f"--max-streams {max_fit} or lower --max-positions")
    return plan
