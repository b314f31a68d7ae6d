#!/usr/bin/env python
"""The floor under a frame made of many dependent kernels (issue 16's B = 1): a CUDA graph of a
chain of N Triton kernels, each reading what the one before it wrote, with and without
programmatic dependent launch (PDL, as the engine's frame graphs use it: wait, then let the
successor launch). The kernels:

- `empty`: P programs, each loads one float its predecessor wrote and stores one (the cost of a
  launch in a chain: start, dependency, tail);
- `stream`: the same, plus each program sums its share of a weight matrix of W MB (fp16, 16 KB
  per step) that the chain rotates through buffers past the L2, as a B = 1 product reads its
  weights (q|k|v 8 MB, o_proj 4, gate|up 12, down 6);
- `stream+prefetch`: the stream kernel issuing `cp.async.bulk.prefetch.L2` for its whole slice
  before the PDL wait (while its predecessor runs).

Prints µs per kernel (graph replay, CUDA events, median of 20) for each (kind, P, W, PDL) and
writes them to $OUT/launch_floor.json. A frame of ~830 launches pays at least N x the `empty`
figure, and its products at least the `stream` figures of their sizes (BENCHMARKS.md, session 36).

  PYTHONPATH=. python3 scripts/gpu_launch_floor.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tts_server.engines.batched import pdl  # noqa: E402


@triton.jit
def _empty(x_ptr, y_ptr, GDC: tl.constexpr):
    pdl.enter(GDC)
    pid = tl.program_id(0)
    v = tl.load(x_ptr + pid)
    tl.store(y_ptr + pid, v + 1.0)


@triton.jit
def _stream(x_ptr, y_ptr, w_ptr, per_prog, GDC: tl.constexpr, BLOCK: tl.constexpr, PREFETCH: tl.constexpr = False):
    pid = tl.program_id(0)
    base = w_ptr + pid.to(tl.int64) * per_prog
    if PREFETCH:  # the program's whole slice into L2 before the dependency wait: 128 bulk prefetches
        piece = per_prog // 128  # elements per thread's prefetch (a multiple of 64: 128 bytes)
        addr = base + tl.arange(0, 128) * piece
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                                  [addr, tl.full((128,), 0, tl.int32) + piece * 2], dtype=tl.int32,
                                  is_pure=False, pack=1)
    pdl.enter(GDC)
    acc = tl.zeros((BLOCK,), tl.float32)
    for off in range(0, per_prog, BLOCK):
        acc += tl.load(base + off + tl.arange(0, BLOCK)).to(tl.float32)
    v = tl.load(x_ptr + pid)
    tl.store(y_ptr + pid, v + tl.sum(acc, axis=0))


def chain(kind: str, n: int, progs: int, mb: float, use_pdl: bool, bufs: list[torch.Tensor], prefetch: bool = False):
    dev = bufs[0].device if bufs else torch.device("cuda")
    a = torch.zeros(max(progs, 1), device=dev)
    b = torch.zeros_like(a)
    per_prog = int(mb * 2**20 / 2 / progs) // 8192 * 8192 if kind == "stream" else 0

    def run():
        x, y = a, b
        with pdl.scope(use_pdl):
            for i in range(n):
                if kind == "empty":
                    _empty[(progs,)](x, y, **pdl.kw())
                else:
                    _stream[(progs,)](x, y, bufs[i % len(bufs)], per_prog, BLOCK=8192, num_warps=4,
                                      PREFETCH=prefetch, **pdl.kw())
                x, y = y, x
    run()  # compile
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.graph(g, stream=side):
        run()
    ms = []
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        g.replay()
    for _ in range(20):
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ms.append(e0.elapsed_time(e1))
    return statistics.median(ms) * 1e3 / n, per_prog * progs * 2 / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--n", type=int, default=830)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), n=args.n, pdl_supported=pdl.supported(),
               rows=[])
    # 16 buffers of 12 MB (192 MB) rotate past the L2 (50 MB on an H100, 60 on an H200)
    bufs = [torch.randn(6 * 2**20, device="cuda").half() for _ in range(16)]
    cases = [("empty", p, 0.0) for p in (1, 32, 128, 264)]
    cases += [("stream", p, mb) for p in (64, 128, 256) for mb in (4.0, 8.0, 12.0)]
    # and the stream kernels with their slice prefetched into L2 before the PDL wait
    cases += [("stream+prefetch", p, mb) for p in (128, 256) for mb in (4.0, 8.0, 12.0)]
    for kind, p, mb in cases:
        for use_pdl in (False, True):
            us, real_mb = chain(kind.split("+")[0], args.n if kind == "empty" else 200, p, mb, use_pdl, bufs,
                                prefetch=kind.endswith("+prefetch"))
            row = dict(kind=kind, programs=p, mb=round(real_mb, 2), pdl=use_pdl, us_per_kernel=round(us, 3),
                       gb_s=round(real_mb * 2**20 / (us * 1e-6) / 1e9, 1) if real_mb else None)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    (out / "launch_floor.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
