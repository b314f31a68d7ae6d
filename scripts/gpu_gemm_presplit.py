#!/usr/bin/env python
"""GPU experiment (issue 16, B = 64..256 frames): the decode frame's products with x already
rounded to fp16 by its producer (one [M, K] fp16 read per output tile) against today's `_gemm`,
which reads x as fp32 and rounds it in every output tile. At M = 256 an output tile re-reads its
x rows once per column tile, so fp32 x doubles the L2 -> SM traffic. Every candidate tile is
checked bitwise against `_gemm` (reduced) at the same M and at M = 1; times are CUDA-graph
replays with 8 weight copies in rotation (weights from HBM, as in a frame).

Then `_gemm` itself with fp16 x (the frame's path since session 31) over its tiles per M bucket
(X16_ONLY=1: that section only; X16_SHAPES=o_proj,...: those products only; `down` there takes
swiglu's scaled fp16 row, as the frame does since session 33; X16_MS=4,64: those row counts;
X16_BK=256: that BLOCK_K for every candidate). With TTS_GEMM_SUB=256 it sweeps the tiles of the
opt-in sub-piece order (tk_gemm.SUB_COLS).

  PYTHONPATH=. python3 scripts/gpu_gemm_presplit.py   # writes $OUT/gemm_presplit.json
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_batched_ops import GEMMS, bench_graph  # noqa: E402

from tts_server.engines.batched import ops, tk_gemm  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/gemm_presplit_out")
MS = tuple(int(m) for m in os.environ.get("MS", "64,128,256").split(","))
COPIES = 8
TILES = [(64, 64, 4, 4), (64, 128, 4, 4), (64, 128, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3), (128, 128, 8, 3),
         (128, 128, 4, 3), (64, 256, 8, 3), (128, 256, 8, 2), (256, 64, 8, 3), (256, 128, 8, 2)]
FP16_SHAPES = ("qkv", "o_proj", "gate_up", "cp_head")


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name(), "shapes": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, kind, n, k in GEMMS:
        if name not in FP16_SHAPES or os.environ.get("X16_ONLY") == "1":
            continue
        sw = kind == "swiglu"
        ws = [(torch.randn(n, k, device="cuda", generator=g) * 0.03).half() for _ in range(COPIES)]
        w2s = [(torch.randn(n, k, device="cuda", generator=g) * 0.03).half() for _ in range(COPIES)] if sw else [None] * COPIES
        entry: dict = {}
        for m in MS:
            x = torch.randn(m, k, device="cuda", generator=g)
            parts = tk_gemm.split_parts(x, 0)
            ref = tk_gemm._gemm(x, ws[0], w2s[0])
            ref1 = tk_gemm._gemm(x[:1], ws[0], w2s[0])
            reduce = name == "qkv" or sw  # o_proj and the heads go out as K pieces in the frame
            row: dict = {"base_tile": list(tk_gemm.config(kind, n, k, m, fp16=True)),
                         "base_us": round(bench_graph(lambda i: tk_gemm._gemm(x, ws[i % COPIES], w2s[i % COPIES],
                                                                               reduce=reduce), 16), 2),
                         "split_us": round(bench_graph(lambda i: tk_gemm.split_parts(x, 0), 16), 2), "tiles": {}}
            for tile in TILES:
                if n % tile[1] or tile[0] > max(64, m * 2):
                    continue
                key = "x".join(map(str, tile))
                try:
                    same = (torch.equal(tk_gemm.gemm_big(x, ws[0], w2s[0], tile, parts), ref)
                            and torch.equal(tk_gemm.gemm_big(x[:1], ws[0], w2s[0], tile), ref1))
                    t = {"bitwise_equal": bool(same)}
                    if same:
                        t["us"] = round(bench_graph(lambda i: tk_gemm.gemm_big(x, ws[i % COPIES], w2s[i % COPIES],
                                                                               tile, parts), 16), 2)
                except Exception as e:  # noqa: BLE001 - a tile that fails to compile is recorded
                    t = {"error": repr(e)[:200]}
                row["tiles"][key] = t
            best = min(((v["us"], k2) for k2, v in row["tiles"].items() if "us" in v), default=None)
            row["best"] = best
            entry[m] = row
            print(name, m, "base", row["base_tile"], row["base_us"], "split", row["split_us"], "best", best,
                  {k2: v.get("us", v.get("bitwise_equal", v.get("error"))) for k2, v in row["tiles"].items()},
                  flush=True)
        res["shapes"][name] = entry
    res["x16_tiles"] = x16_tiles()
    with open(os.path.join(OUT, "gemm_presplit.json"), "w") as f:
        json.dump(res, f, indent=1)


# `_gemm` itself with x in fp16 (the decode frame's path): per M bucket, today's tile and candidates
# through tk_gemm.OVERRIDE, each bitwise against `_gemm` with fp32 x
X16_MS = tuple(int(m) for m in os.environ.get("X16_MS", "1,16,32,64,128,256").split(","))
# X16_BK: another BLOCK_K for every candidate (with TTS_GEMM_SUB=256, sub-pieces of one step at
# 256: whether the fold then costs the tiles less); the reference stays the default config's
X16_BK = int(os.environ.get("X16_BK", "0"))
X16_TILES = [(16, 16, 2, 3), (16, 32, 4, 5), (16, 32, 4, 3), (16, 64, 2, 4), (16, 64, 4, 5), (16, 128, 4, 4),
             (32, 32, 4, 4), (32, 64, 4, 4), (64, 32, 4, 4), (64, 64, 4, 4), (64, 64, 4, 3), (64, 128, 4, 4),
             (128, 64, 8, 3), (128, 128, 8, 3)]


def x16_tiles() -> dict:
    g = torch.Generator(device="cuda").manual_seed(1)
    out: dict = {}
    for name, kind, n, k in GEMMS:
        if name not in FP16_SHAPES + ("down",) or name not in os.environ.get("X16_SHAPES", name):
            continue
        sw = kind == "swiglu"
        ws = [(torch.randn(n, k, device="cuda", generator=g) * 0.03).half() for _ in range(COPIES)]
        w2s = [(torch.randn(n, k, device="cuda", generator=g) * 0.03).half() for _ in range(COPIES)] if sw else [None] * COPIES
        reduce = name == "qkv" or sw  # o_proj, down and the heads go out as K pieces in the frame
        # down: x is swiglu's fp16 row times 2^-MLP_SHIFT (frame.stack_forward), the parts scaled back
        shift = ops.MLP_SHIFT if name == "down" else 0
        for m in X16_MS:
            x = torch.randn(m, k, device="cuda", generator=g)
            x16 = x.half()
            ref = tk_gemm._gemm(x16 if shift else x, ws[0], w2s[0], reduce=reduce, shift=shift)
            cfg = tk_gemm.config(kind, n, k, m, fp16=True, x16=True)
            row = {"config": list(cfg), "x32_us": None if shift else round(bench_graph(
                lambda i: tk_gemm._gemm(x, ws[i % COPIES], w2s[i % COPIES], reduce=reduce), 16), 2), "tiles": {}}
            for bm, bn, warps, stages in X16_TILES:
                if n % bn or bm > max(16, 2 * m):
                    continue
                key = f"{bm}x{bn}x{warps}x{stages}"
                tk_gemm.OVERRIDE[kind] = (bm, bn, X16_BK or cfg[2], warps, stages) + tuple(cfg[5:])
                try:
                    same = torch.equal(tk_gemm._gemm(x16, ws[0], w2s[0], reduce=reduce, shift=shift), ref)
                    row["tiles"][key] = round(bench_graph(lambda i: tk_gemm._gemm(
                        x16, ws[i % COPIES], w2s[i % COPIES], reduce=reduce, shift=shift), 16), 2) \
                        if same else "NOT EQUAL"
                except Exception as e:  # noqa: BLE001
                    row["tiles"][key] = repr(e)[:120]
                finally:
                    tk_gemm.OVERRIDE.clear()
            row["x16_default_us"] = round(bench_graph(
                lambda i: tk_gemm._gemm(x16, ws[i % COPIES], w2s[i % COPIES], reduce=reduce, shift=shift), 16), 2)
            timed = [(v, t) for t, v in row["tiles"].items() if isinstance(v, float)]
            row["best"] = min(timed) if timed else None
            out[f"{name}|{m}"] = row
            print("x16", name, m, "config", cfg[:2] + cfg[3:5], "x32", row["x32_us"], "x16 default",
                  row["x16_default_us"], "best", row["best"], flush=True)
    return out


if __name__ == "__main__":
    main()
