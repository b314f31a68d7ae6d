"""GPU experiment: bigger tiles for the prefill's many-row GEMMs (M = 256..4096 prompt rows), kept
batch-invariant. Same method as gpu_gemm_tiles.py (which covers M <= 256): candidates keep the
tuned (BLOCK_K, K chunk, x terms), so each row's reduction order is unchanged; each candidate's
output is checked bitwise against the tuned tile (M = 1024 random rows, and M = 1), and the equal
ones are timed (CUDA-graph replays). Usage: PYTHONPATH=. python3 scripts/gpu_gemm_big_m.py ;
writes $OUT/gemm_big_m.json."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_batched_ops import GEMMS, bench_graph  # noqa: E402

from gpu_gemm_tiles import run, shape_case  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/gemm_big_m_out")
MS = (256, 512, 1024, 2048, 4096)
BIG = [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 3), (128, 128, 8, 3),
       (128, 128, 8, 4), (128, 128, 4, 3), (64, 256, 8, 3), (128, 256, 8, 3)]


def time_cfg(kind, n, k, cfg):
    nw = 2 if kind == "swiglu" else 1
    w = [(torch.randn(n, k, device="cuda") * 0.03).bfloat16() for _ in range(nw)]
    res = {}
    for m in MS:
        x = torch.randn(m, k, device="cuda")
        res[m] = round(bench_graph(lambda i: run(kind, x, w[0], w[-1], cfg), 4), 1)
    return res


def main():
    os.makedirs(OUT, exist_ok=True)
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, kind, n, k in GEMMS:
        tuned, w, w2, x, ref = shape_case(g, kind, n, k, 1024)
        bk, chunk, terms = tuned[2], tuned[5], tuned[6]
        shape = {"tuned": list(tuned), "candidates": {}}
        for bm, bn, wp, st in BIG:
            cfg = (bm, bn, bk, wp, st, chunk, terms)
            if n % bn:
                continue
            try:
                out = run(kind, x, w, w2, cfg)
                out1 = run(kind, x[:1], w, w2, cfg)
                torch.cuda.synchronize()
                same = bool(torch.equal(out, ref) and torch.equal(out1[0], ref[0]))
                entry = {"bitwise_equal": same}
                if same:
                    entry["us"] = time_cfg(kind, n, k, cfg)
            except Exception as e:  # noqa: BLE001 - a tile that does not compile is recorded
                entry = {"error": repr(e)[:300]}
            shape["candidates"][str(cfg)] = entry
            print(name, cfg, entry, flush=True)
        res["shapes"][name] = shape
    res["wall_s"] = round(time.time() - t0, 1)
    with open(os.path.join(OUT, "gemm_big_m.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
