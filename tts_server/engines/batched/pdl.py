"""Programmatic dependent launch (PDL, Hopper and later) for the batched engine's Triton kernels
(and the persistent decode attention split, attn_kernel.py, which asks `active()` at its launch).

A B = 1 frame is ~940 short kernels, and much of each one's time is its launch, its programs
starting and its tail. A kernel launched with PDL may start while its predecessor still runs: it
waits (griddepcontrol.wait) at its very top until the predecessor has finished and flushed, then
lets its own successor launch (griddepcontrol.launch_dependents). What a kernel computes does not
change, so outputs are bitwise the same with PDL on or off (scripts/gpu_pdl_ab.py checks it).

Measured on an H100 (benchmarks/results/h100-pdl-ab-*.json, h100-pdl-rows-ab-*.json): frame
graphs of B <= 128 rows get faster (session 12's kernels: B = 1 4.91 -> 4.47 ms; session 29's:
B = 16 / 64 / 128 4.58 -> 4.29, 6.55 -> 6.38, 9.19 -> 8.98 ms), B = 256 slower (13.96 -> 14.08),
and a weight prefetch into L2 before the wait was slower at every B (again in session 36, each
product of 1-16 rows prefetching its own rows: B = 1 3.03 -> 3.44 ms on an H200). So PDL is on
only inside `scope(True)`, which the frame graphs and the prefill row graphs of small buckets are
captured in (graphs.PDL_MAX_ROWS, prefill.PDL_MAX_ROWS); a CUDA graph keeps what was set at its
capture.
TTS_PDL=0 turns it off everywhere."""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_capable: bool | None = None
_on = False


def supported() -> bool:
    global _capable
    if _capable is None:
        _capable = (not _INTERPRET and torch.cuda.is_available()
                    and torch.cuda.get_device_capability()[0] >= 9)
    return _capable and os.environ.get("TTS_PDL", "1") != "0"


@contextlib.contextmanager
def scope(on: bool):
    """Launch the engine kernels inside with PDL when `on` (and the device supports it)."""
    global _on
    before, _on = _on, on and supported()
    try:
        yield
    finally:
        _on = before


def max_rows(graphs: str, default: int) -> int:
    """The largest bucket of a graph family (FRAME, PREFILL) captured with PDL; the
    environment's TTS_PDL_<family>_ROWS replaces the measured default (A/Bs)."""
    return int(os.environ.get(f"TTS_PDL_{graphs}_ROWS", default))


def active() -> bool:
    """Whether kernels launched now get PDL (inside scope(True) on a capable device)."""
    return _on


def kw() -> dict:
    """Launch keywords for a kernel taking `GDC: tl.constexpr` that calls `enter(GDC)` first."""
    return dict(GDC=True, launch_pdl=True) if _on else dict(GDC=False)


@triton.jit
def enter(GDC: tl.constexpr):
    """First statement of every engine kernel: wait for the predecessor's results, then let the
    successor launch (it waits for ours in turn). Because every kernel waits before it lets the
    next one start, what was written two launches back or earlier is visible before the wait:
    tk_sample's draw (early=True) makes its noise from such inputs ahead of it."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
