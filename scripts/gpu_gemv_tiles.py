"""GPU experiment: faster tiles for the frame's products at a few rows (B = 1..8), where a product
reads its weights at ~1 TB/s (benchmarks/results/h100-frame-profile-ee514eb-attn-tc.json).

The M <= 16 tiles were swept with 3 or 5 pipeline stages (scripts/gpu_gemm_tiles.py); a program
of 16 weight rows then has 12-20 KB of loads in flight, too few bytes per SM to stream HBM. This
sweep adds deeper pipelines (up to all of K in flight), 1-warp programs and narrower tiles. Each
candidate keeps the shape's (BLOCK_K, chunk, terms), so each output's reduction order; its output
is checked bitwise against the tuned tile's. Times are CUDA-graph replays under PDL (as the small
frame buckets run), weights rotated past L2.

  PYTHONPATH=. python3 scripts/gpu_gemv_tiles.py   # writes $OUT/gemv_tiles.json
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_batched_ops import GEMMS  # noqa: E402
from gpu_gemm_tiles import run, shape_case, time_cfg  # noqa: E402

from tts_server.engines.batched import pdl, tk_gemm  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/gemv_tiles_out")
MS = tuple(int(m) for m in os.environ.get("MS", "1,2,4,8").split(","))
SHAPES = os.environ.get("SHAPES", "qkv,o_proj,gate_up,down,cp_head").split(",")
CANDS = [(16, bn, w, s) for bn, w, s in itertools.product((16, 32, 64), (1, 2, 4), (3, 5, 8))]


def main():
    os.makedirs(OUT, exist_ok=True)
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "commit": os.environ.get("COMMIT", "?"), "ms": MS, "shapes": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    with pdl.scope(True):
        for name, kind, n, k in [gm for gm in GEMMS if gm[0] in SHAPES]:
            tuned, w, w2, x, ref = shape_case(g, kind, n, k, 16)
            bk, chunk, terms = tuned[2], tuned[5], tuned[6]
            cur = {m: tk_gemm.config(kind, n, k, m) for m in MS}
            shape = {"current": {m: list(c) for m, c in cur.items()}, "candidates": {}}
            cands = [(bm, bn, bk, wp, st, chunk, terms) for bm, bn, wp, st in CANDS] + list(cur.values())
            for cfg in dict.fromkeys(cands):
                key = str(cfg)
                try:
                    out = run(kind, x, w, w2, cfg)
                    torch.cuda.synchronize()
                    same = bool(torch.equal(out, ref))
                    entry = {"bitwise_equal": same}
                    if same:
                        entry["us"] = time_cfg(kind, n, k, cfg, MS)
                except Exception as e:  # noqa: BLE001 - a tile that does not fit is recorded
                    entry = {"error": repr(e)[:200]}
                shape["candidates"][key] = entry
            best = {}
            for m in MS:
                timed = sorted((v["us"][m], c) for c, v in shape["candidates"].items() if "us" in v)
                if timed:
                    cur_us = shape["candidates"][str(cur[m])].get("us", {}).get(m)
                    best[m] = {"cfg": timed[0][1], "us": timed[0][0], "current_us": cur_us,
                               "top5": timed[:5]}
            shape["best_equal"] = best
            res["shapes"][name] = shape
            print(name, json.dumps({m: (b["cfg"], b["us"], b["current_us"]) for m, b in best.items()}), flush=True)
            with open(os.path.join(OUT, "gemv_tiles.json"), "w") as f:
                json.dump(res, f, indent=1)
    res["wall_s"] = round(time.time() - t0, 1)
    with open(os.path.join(OUT, "gemv_tiles.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
