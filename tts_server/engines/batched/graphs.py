"""CUDA graphs of the batched frame, two per batch bucket (1, 2, 4, ..., max): the frame's codes
(`FrameStep.predict`) and the talker step after them (`FrameStep.advance`), captured at start-up
into one shared memory pool (replays never overlap). A step pads its rows into the next bucket
with the scratch slot and replays that bucket's graphs."""

from __future__ import annotations

import time

import torch

from . import pdl
from .frame import FrameStep

# buckets up to this many rows are captured with programmatic dependent launch (pdl.py). On the
# H100 at today's kernels (scripts/gpu_pdl_ab.py, benchmarks/results/h100-pdl-rows-ab-ea18c78.json;
# bits equal) it pays up to 128 rows (B = 16 / 32 / 64 / 128: -6.4 / -4.4 / -2.6 / -2.1%) and
# costs at 256 (+0.8%)
PDL_MAX_ROWS = pdl.max_rows("FRAME", 128)


def bucket_sizes(max_rows: int) -> list[int]:
    """1, 2, 4, ... up to and including max_rows (the last bucket is max_rows itself)."""
    sizes, b = [], 1
    while b < max_rows:
        sizes.append(b)
        b *= 2
    return sizes + [max_rows]


def bucket_for(n: int, sizes: list[int]) -> int:
    for b in sizes:
        if b >= n:
            return b
    raise ValueError(f"{n} rows exceed the largest bucket {sizes[-1]}")


class StepGraphs:
    """predict[b] / advance[b] replay `step.predict(rows[:b])` / `step.advance(rows[:b])`; the
    caller fills rows[:b] (device, int64) first. predict=False: the advance graphs only (the
    code-predictor half runs as a CUDA kernel, cuda_frame.py); rows: the engine's own device rows
    buffer to replay from (default: a new one)."""

    def __init__(self, step: FrameStep, sizes: list[int], scratch_slot: int, warmup: int = 2,
                 predict: bool = True, rows: torch.Tensor | None = None):
        dev = step.out.device
        self.sizes = sizes
        self.rows = rows if rows is not None else torch.full((sizes[-1],), scratch_slot, dtype=torch.int64, device=dev)
        self.predict: dict[int, torch.cuda.CUDAGraph] = {}
        self.advance: dict[int, torch.cuda.CUDAGraph] = {}
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(dev)
        t0 = time.perf_counter()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # compile the kernels and warm the allocator off the capture
            for b in reversed(sizes):
                step.consts(b)
                with pdl.scope(b <= PDL_MAX_ROWS):
                    for _ in range(warmup):
                        (step if predict else step.advance)(self.rows[:b])
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(sizes):  # largest first, so smaller graphs reuse its pool blocks
            halves = ((self.predict, step.predict),) if predict else ()
            for graphs, half in halves + ((self.advance, step.advance),):
                g = torch.cuda.CUDAGraph()
                # capture on a stream of dev: torch.cuda.graph's own default stream is made once,
                # on whichever GPU was current then, so a second GPU's capture would fail there
                with torch.cuda.graph(g, pool=pool, stream=side), pdl.scope(b <= PDL_MAX_ROWS):
                    half(self.rows[:b])
                graphs[b] = g
        torch.cuda.synchronize(dev)
        self.capture_s = time.perf_counter() - t0
        torch.cuda.empty_cache()
        self.memory_bytes = torch.cuda.memory_reserved(dev) - before

    def replay(self, b: int) -> None:
        """The whole frame (both halves)."""
        self.predict[b].replay()
        self.advance[b].replay()
