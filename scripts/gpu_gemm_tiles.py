"""GPU experiment: can the batch-invariant GEMMs pick their tile by M without changing any row's bits?

Each output element's reduction order is fixed by (BLOCK_K, K chunk, x terms); BLOCK_M / BLOCK_N /
warps / stages only say which program computes it (and whether Triton emits wgmma or mma.sync). For
every 0.6B GEMM shape this script runs candidate tiles with the tuned (BLOCK_K, chunk, terms), checks
each candidate's output bitwise against the tuned tile on the same inputs (M = 256 random rows, and
M = 1), and times the bitwise-equal ones at M = 1..256 (CUDA-graph replays, weights rotated past
L2), beside the tile `tk_gemm.config` picks today at each M. Usage:
PYTHONPATH=. python3 scripts/gpu_gemm_tiles.py ; writes $OUT/gemm_tiles.json (DTYPE=fp16: the
matrices in fp16, as params.gemm_dtype serves them on CUDA: one x term; $OUT/gemm_tiles_fp16.json;
SHAPES=qkv,o_proj: only those)."""

from __future__ import annotations

import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_batched_ops import GEMMS, bench_graph  # noqa: E402

from tts_server.engines.batched import ops, tk_gemm  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/gemm_tiles_out")
MS = tuple(int(m) for m in os.environ.get("MS", "1,2,4,8,16,32,64,128,256").split(","))
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}[os.environ.get("DTYPE", "bf16")]
SMALL = [(bm, bn, w, s) for bm, bn, w, s in itertools.product((16,), (16, 32, 64), (2, 4), (3, 5))]
SMALL += [(32, 32, 4, 4), (32, 64, 4, 4), (64, 32, 4, 4), (64, 64, 4, 3), (64, 128, 8, 3)]
# wider ones for 64..256 rows (one x term leaves shared memory for them)
LARGE = [(64, 64, 4, 4), (64, 128, 4, 3), (64, 256, 8, 3), (128, 64, 4, 3), (128, 64, 8, 3),
         (128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3), (32, 128, 4, 3), (16, 128, 4, 3),
         (16, 64, 2, 4), (64, 64, 4, 5), (64, 128, 4, 4)]


def mat(n, k, g=None):
    """A random [n, k] matrix as served: bf16 values, in DTYPE."""
    return (torch.randn(n, k, device="cuda", generator=g) * 0.03).bfloat16().to(DTYPE)


def run(kind, x, w, w2, cfg):
    tk_gemm.OVERRIDE[kind] = cfg
    try:
        return ops.linear(x, w) if kind == "linear" else ops.swiglu(x, w, w2)
    finally:
        tk_gemm.OVERRIDE.pop(kind, None)


def time_cfg(kind, n, k, cfg, ms):
    nw = 2 if kind == "swiglu" else 1
    wbytes = n * k * 2 * nw
    copies = max(2, -(-160_000_000 // wbytes))
    ws = [[mat(n, k) for _ in range(nw)] for _ in range(copies)]
    res = {}
    tk_gemm.OVERRIDE[kind] = cfg
    try:
        for m in ms:
            x = torch.randn(m, k, device="cuda")
            f = (lambda i: ops.linear(x, ws[i % copies][0])) if kind == "linear" else \
                (lambda i: ops.swiglu(x, *ws[i % copies]))
            res[m] = round(bench_graph(f, 2 * copies), 2)
    finally:
        tk_gemm.OVERRIDE.pop(kind, None)
    return res


def shape_case(g, kind, n, k, rows):
    """The tuned tile of a GEMM shape, random weights, `rows` random input rows and the tuned
    tile's output -> (tuned, w, w2, x, ref)."""
    tuned = tk_gemm.config(kind, n, k)
    w, w2 = mat(n, k, g), mat(n, k, g)
    x = torch.randn(rows, k, device="cuda", generator=g) * 3
    return tuned, w, w2, x, run(kind, x, w, w2, tuned)


def main():
    os.makedirs(OUT, exist_ok=True)
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    only = os.environ.get("SHAPES")
    for name, kind, n, k in GEMMS:
        if only and name not in only.split(","):
            continue
        tuned, w, w2, x, ref = shape_case(g, kind, n, k, 256)
        bk, chunk, terms = tuned[2], tuned[5], tuned[6]
        ref1 = run(kind, x[:1], w, w2, tuned)
        assert torch.equal(ref1[0], ref[0]), "tuned tile not row invariant"
        current = {m: tk_gemm.config(kind, n, k, m) for m in MS}
        shape = {"tuned": list(tuned), "dtype": str(DTYPE), "candidates": {},
                 "current": {m: str(c) for m, c in current.items()}}
        cands = [(bm, bn, bk, wp, st, chunk, terms) for bm, bn, wp, st in SMALL + LARGE] + [tuned]
        cands += list(current.values())
        cands += [(tuned[0], tuned[1], bk * 2, tuned[3], 3, chunk, terms),
                  (16, 32, bk // 2, 4, 4, chunk, terms)]  # a different BLOCK_K: expected to differ
        for cfg in dict.fromkeys(cands):
            key = str(cfg)
            try:
                out = run(kind, x, w, w2, cfg)
                out1 = run(kind, x[:1], w, w2, cfg)
                torch.cuda.synchronize()
                same = bool(torch.equal(out, ref) and torch.equal(out1[0], ref[0]))
                entry = {"bitwise_equal": same,
                         "max_abs_diff": float((out - ref).abs().max())}
                if same:
                    entry["us"] = time_cfg(kind, n, k, cfg, MS)
                shape["candidates"][key] = entry
            except Exception as e:  # noqa: BLE001 - a tile that does not compile is recorded
                shape["candidates"][key] = {"error": repr(e)[:300]}
            print(name, key, shape["candidates"][key], flush=True)
        best = {}
        for m in MS:
            timed = [(v["us"][m], c) for c, v in shape["candidates"].items() if "us" in v]
            if timed:
                us, c = min(timed)
                best[m] = {"cfg": c, "us": us,
                           "tuned_us": shape["candidates"][str(tuned)]["us"][m],
                           "current_us": shape["candidates"][str(current[m])].get("us", {}).get(m)}
        shape["best_equal"] = best
        res["shapes"][name] = shape
        print(name, json.dumps(best), flush=True)
        res["wall_s"] = round(time.time() - t0, 1)
        suffix = "_fp16" if DTYPE == torch.float16 else ""
        with open(os.path.join(OUT, f"gemm_tiles{suffix}.json"), "w") as f:  # after every shape
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
