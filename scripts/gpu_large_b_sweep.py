#!/usr/bin/env python
"""Large-batch kernel sweeps for the batched frame, one GPU call (results: $OUT/large_b_sweep.json):

  gemm       more GEMM tiles at M = 16..256 than scripts/gpu_gemm_tiles.py tried (bigger BLOCK_M,
             more warps): each candidate checked bitwise against the tuned tile (M = 256 and 1),
             the bitwise-equal ones timed (CUDA-graph replays, weights rotated past L2)
  cp_attend  the fused code-predictor attention at M = 1 / 64 / 256 rows with 1 / 2 / 4 / 8 warps
             (warps may change the bits, so a pick holds for every M)
  cp_first   the code predictor's first-pass attention (2 query rows per stream over a 1-page
             table): splits of 64 positions vs splits capped at the table (16 positions), bitwise

  PYTHONPATH=. python3 scripts/gpu_large_b_sweep.py [--sections gemm,cp_attend,cp_first]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(__file__))
import gpu_gemm_tiles as tiles  # noqa: E402
from gpu_batched_ops import GEMMS, bench_graph  # noqa: E402

from tts_server.engines.batched import ops, tk_attention, tk_glue  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/large_b_out")
T0 = time.perf_counter()
MS = (16, 32, 64, 128, 256)
CANDS = [(64, 32, 4, 3), (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 8, 3), (64, 256, 8, 3),
         (128, 32, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 4), (32, 64, 4, 4),
         (32, 128, 4, 3), (16, 128, 4, 3), (16, 256, 4, 3), (128, 256, 8, 3)]


def log(*a) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, flush=True)


def gemm() -> dict:
    res = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, kind, n, k in GEMMS[:4]:  # the four layer GEMMs (103 of each per frame)
        tuned, w, w2, x, ref = tiles.shape_case(g, kind, n, k, 256)
        bk, chunk, terms = tuned[2], tuned[5], tuned[6]
        shape = {"tuned": list(tuned), "current_by_m": {}, "candidates": {}}
        from tts_server.engines.batched import tk_gemm
        for m in MS:
            cfg = tk_gemm.config(kind, n, k, m)
            shape["current_by_m"][m] = dict(cfg=list(cfg), us=tiles.time_cfg(kind, n, k, cfg, (m,))[m])
        for bm, bn, wp, st in CANDS:
            cfg = (bm, bn, bk, wp, st, chunk, terms)
            try:
                out = tiles.run(kind, x, w, w2, cfg)
                out1 = tiles.run(kind, x[:1], w, w2, cfg)
                torch.cuda.synchronize()
                same = bool(torch.equal(out, ref) and torch.equal(out1[0], ref[0]))
                entry = {"bitwise_equal": same}
                if same:
                    entry["us"] = tiles.time_cfg(kind, n, k, cfg, MS)
            except Exception as e:  # noqa: BLE001 - a tile that does not compile is recorded
                entry = {"error": repr(e)[:200]}
            shape["candidates"][str(cfg)] = entry
        best = {}
        for m in MS:
            timed = [(v["us"][m], c) for c, v in shape["candidates"].items() if "us" in v]
            cur = shape["current_by_m"][m]
            us, c = min(timed) if timed else (None, None)
            best[m] = dict(best=c, us=us, current=cur["cfg"], current_us=cur["us"])
            log(f"{name} M {m}: current {cur['us']} us {cur['cfg']}  best {us} us {c}")
        shape["best"] = best
        res[name] = shape
    return res


def cp_attend() -> dict:
    res = {}
    nh, nkv, hd, bs = 16, 8, 128, 16
    g = torch.Generator(device="cuda").manual_seed(1)
    for m in (1, 64, 256):
        qkv = torch.randn(m, (nh + 2 * nkv) * hd, device="cuda", generator=g)
        qn = torch.randn(hd, device="cuda", generator=g) * 0.1 + 1
        kn = torch.randn(hd, device="cuda", generator=g) * 0.1 + 1
        cos, sin = torch.randn(hd, device="cuda", generator=g), torch.randn(hd, device="cuda", generator=g)
        kp = torch.randn(m, nkv, bs, hd, device="cuda", generator=g)
        vp = torch.randn(m, nkv, bs, hd, device="cuda", generator=g)
        row, outs = {}, {}
        for warps in (1, 2, 4, 8):
            tk_glue.CP_ATTEND_WARPS = warps
            for pos in (1, 8, 15):
                f = lambda i, pos=pos: tk_glue.cp_attend(qkv, qn, kn, cos, sin, kp, vp, pos, nh, nkv, 1e-6, 0.088)  # noqa: E731
                row[f"w{warps}|pos{pos}"] = round(bench_graph(f, 20), 2)
            outs[warps] = tk_glue.cp_attend(qkv, qn, kn, cos, sin, kp.clone(), vp.clone(), 8, nh, nkv, 1e-6, 0.088)
        tk_glue.CP_ATTEND_WARPS = 4
        row["bitwise_vs_w4"] = {w: bool(torch.equal(o, outs[4])) for w, o in outs.items()}
        res[f"M{m}"] = row
        log(f"cp_attend M {m}: {row}")
    return res


def cp_first() -> dict:
    res = {}
    nh, nkv, hd, bs = 16, 8, 128, 16
    g = torch.Generator(device="cuda").manual_seed(2)
    for b in (1, 64, 256):
        kp = torch.randn(b, nkv, bs, hd, device="cuda", generator=g)
        vp = torch.randn(b, nkv, bs, hd, device="cuda", generator=g)
        q = torch.randn(2 * b, nh, hd, device="cuda", generator=g)
        table = torch.arange(b, dtype=torch.int32, device="cuda").repeat_interleave(2)[:, None].contiguous()
        lens = torch.tensor([1, 2], dtype=torch.int32, device="cuda").repeat(b)
        row, outs = {}, {}
        for name, cap in (("split64", False), ("capped", True)):
            tk_attention.CAP_SPLIT_TO_TABLE = cap
            row[name] = round(bench_graph(lambda i: ops.paged_attention(q, kp, vp, table, lens, 0.088), 20), 2)
            outs[name] = ops.paged_attention(q, kp, vp, table, lens, 0.088)
        tk_attention.CAP_SPLIT_TO_TABLE = True
        row["bitwise"] = bool(torch.equal(outs["split64"], outs["capped"]))
        res[f"B{b}"] = row
        log(f"cp first pass B {b}: {row}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="cp_first,cp_attend,gemm")
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    res: dict = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    for name in args.sections.split(","):
        log("==", name)
        try:
            res[name] = globals()[name]()
        except Exception:
            res[name] = dict(error=traceback.format_exc())
            log(res[name]["error"])
        with open(os.path.join(OUT, "large_b_sweep.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
    log("done")


if __name__ == "__main__":
    main()
