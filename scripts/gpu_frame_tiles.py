#!/usr/bin/env python
"""A GEMM tile judged by the frame, not alone (issue 16). A tile sweep times each product in
isolation (`gpu_gemm_presplit.py`, `gpu_gemm_tiles.py`); inside a frame's graph, beside its
neighbours and PDL, the winner can lose: session 33's sweep found the fp16 down projection 10%
faster at 1-16 rows with 16x32 tiles, and the B = 1 frame got 3% slower with them. This script
puts each candidate tile into one row bucket of one product's table (`tk_gemm.BY_M_X16`,
`BY_M_FP16` or `BY_M`), builds a fresh engine per candidate (the graphs capture the tile), and
times graph-replay frames at the given B (mixed contexts), in ROUNDS rounds that alternate the
candidates; each candidate's codes and hidden states over 8 sampled frames of 4 and of B
streams must equal the default's (a tile may move work, never bits).

  PYTHONPATH=. python3 scripts/gpu_frame_tiles.py --shape linear,1024,3072 --table x16 --bucket 16 \\
      --tiles 16x32x4x5,16x64x4x5 --sizes 1,16 --out $OUT     # writes $OUT/frame_tiles.json

A tile is BLOCK_M x BLOCK_N x warps x stages; "default" (always run first) is the table as it is.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_batched_engine import fake_admit, load_weights, log, time_replays  # noqa: E402
from gpu_pdl_ab import signature  # noqa: E402

from tts_server.engines.batched import tk_gemm  # noqa: E402
from tts_server.engines.batched.checks import mixed_lengths  # noqa: E402
from tts_server.engines.batched.engine import BatchedEngine  # noqa: E402

TABLES = {"x16": "BY_M_X16", "fp16": "BY_M_FP16", "bf16": "BY_M"}


def with_tile(entries: tuple, bucket: int, tile: tuple | None) -> tuple:
    """A table entry's (max rows, tile) buckets with rows (previous bound, bucket] on `tile`; a
    shape the table lacks gets a last bucket of None (the other rows keep the next table's tile)."""
    rest = [(m, t) for m, t in (entries or ((1 << 30, None),)) if m != bucket]
    return tuple(sorted(rest + [(bucket, tile)], key=lambda e: e[0]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", required=True, help="kind,N,K as in tk_gemm.TUNED, e.g. linear,1024,3072")
    ap.add_argument("--table", choices=sorted(TABLES), default="x16")
    ap.add_argument("--bucket", type=int, required=True, help="the bucket's largest row count")
    ap.add_argument("--tiles", required=True, help="comma-separated BMxBNxWARPSxSTAGES candidates")
    ap.add_argument("--sizes", default="1,16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    kind, n, k = args.shape.split(",")
    key = (kind, int(n), int(k))
    table = getattr(tk_gemm, TABLES[args.table])
    original = table.get(key, ())
    cands = {"default": None} | {t: tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",") if t}
    sizes = [int(s) for s in args.sizes.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, shape=list(key), table=args.table,
                     bucket=args.bucket, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     replay_ms={c: {b: [] for b in sizes} for c in cands}, bitwise_equal_to_default={})
    w = load_weights("synthetic")
    ref = None
    for r in range(args.rounds):
        for name, tile in cands.items():
            if tile is None:
                table[key] = original
            else:
                table[key] = with_tile(original, args.bucket, tile)
            log(f"== round {r + 1} {name}: {table[key]}")
            eng = BatchedEngine(w, max_streams=256, max_positions=2048, num_blocks=256 * 17 + 1)
            for b in sizes:
                ms = time_replays(eng, fake_admit(eng, mixed_lengths(b), margin=64), args.iters)
                res["replay_ms"][name][b].append(ms)
                log(f"  B {b:3d} mixed: {ms:.3f} ms")
            if r == 0:
                sig = signature(eng, 4, 8) | signature(eng, max(sizes), 8)
                ref = sig if name == "default" else ref
                res["bitwise_equal_to_default"][name] = {f: bool(np.array_equal(v, ref[f])) for f, v in sig.items()}
                log("  bitwise:", res["bitwise_equal_to_default"][name])
            del eng
            torch.cuda.empty_cache()
    table[key] = original
    res["median_ms"] = {c: {b: float(np.median(v)) for b, v in per.items()} for c, per in res["replay_ms"].items()}
    for c, per in res["median_ms"].items():
        log(f"{c:14s} " + "  ".join(f"B {b}: {v:.3f}" for b, v in per.items()))
    (out / "frame_tiles.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
