"""GPU experiment: the prefill's many-row products through tk_gemm.gemm_big (x split into bf16
hi / lo once, one program over all K pieces, no partial products) against `_gemm` (the split
inside every output tile; K pieces as partial products). Checks every candidate tile bitwise
against `_gemm` (M = 4096 and M = 1), times both (CUDA graphs), then times one eager batched
prefill of 145 prompts' worth of rows (4,313) with the switch off and on, bitwise compared.

  PYTHONPATH=. python3 scripts/gpu_gemm_big.py   # writes $OUT/gemm_big.json
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_batched_ops import GEMMS, bench_graph  # noqa: E402

from tts_server.engines.batched import tk_gemm  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/gemm_big_out")
MS = (512, 1024, 2048, 4096)
# (BLOCK_M, BLOCK_N, warps, stages) by the shape's BLOCK_K (the hi and lo tiles double x's
# shared memory: 228 KB holds 2 stages of 128 x 128 at BLOCK_K 128)
TILES = {128: [(128, 128, 8, 2), (64, 128, 4, 2), (128, 64, 8, 2), (128, 64, 4, 2), (64, 64, 4, 3), (64, 256, 8, 2)],
         64: [(128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3), (128, 64, 4, 4), (64, 128, 4, 4), (256, 128, 8, 2)]}


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name(), "shapes": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, kind, n, k in GEMMS[:4]:
        sw = kind == "swiglu"
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.03).bfloat16()
        w2 = (torch.randn(n, k, device="cuda", generator=g) * 0.03).bfloat16() if sw else None
        xs = {m: torch.randn(m, k, device="cuda", generator=g) for m in MS}
        ref = tk_gemm._gemm(xs[4096], w, w2)
        ref1 = tk_gemm._gemm(xs[4096][:1], w, w2)
        entry: dict = {"base_us": {}, "base_parts_us": {}, "tiles": {}}
        for m in MS:
            entry["base_us"][m] = round(bench_graph(lambda i: tk_gemm._gemm(xs[m], w, w2), 4), 1)
            if not sw:
                entry["base_parts_us"][m] = round(bench_graph(lambda i: tk_gemm._gemm(xs[m], w, w2, reduce=False), 4), 1)
        parts = {m: tk_gemm.split_parts(xs[m]) for m in MS}
        entry["split_us"] = {m: round(bench_graph(lambda i: tk_gemm.split_parts(xs[m]), 4), 1) for m in MS}
        for tile in TILES[tk_gemm.config(kind, n, k)[2]]:
            if n % tile[1]:
                continue
            key = "x".join(map(str, tile))
            try:
                same = (torch.equal(tk_gemm.gemm_big(xs[4096], w, w2, tile), ref)
                        and torch.equal(tk_gemm.gemm_big(xs[4096][:1], w, w2, tile), ref1))
                t = {"bitwise_equal": bool(same)}
                if same:
                    t["us_presplit"] = {m: round(bench_graph(lambda i: tk_gemm.gemm_big(xs[m], w, w2, tile, parts[m]), 4), 1)
                                        for m in MS}
            except Exception as e:  # noqa: BLE001 - a tile that fails to compile is recorded
                t = {"error": repr(e)[:200]}
            entry["tiles"][key] = t
        res["shapes"][name] = entry
        best = min(((v["us_presplit"][4096], k2) for k2, v in entry["tiles"].items() if "us_presplit" in v), default=None)
        print(name, "base", entry["base_us"], "parts", entry["base_parts_us"], "split", entry["split_us"], "best", best,
              {k2: v.get("bitwise_equal", v.get("error")) for k2, v in entry["tiles"].items()}, flush=True)
        if best:
            entry["best"] = best[1]
    # one eager batched prefill of 4,313 rows (145 English prompts' worth), switch off / on
    from tts_server.engines.batched.checks import random_weights
    from tts_server.engines.batched.kv_pool import PagedKV
    from tts_server.engines.batched.params import prepare
    from tts_server.engines.batched.prefill import prefill_rows_fp32_attention

    p = prepare(random_weights("cuda"))
    cfg = p.talker.cfg
    lens = [30 - (i % 7) for i in range(145)]
    lens[-1] += 4313 - sum(lens)
    kv = PagedKV(cfg, 146, 4096, 146 * 2 + 8, 64, torch.bfloat16, torch.device("cuda"))
    for s, n in enumerate(lens):
        assert kv.ensure(s, n)
    kv.sync()
    blocks = [kv.blocks(s) for s in range(len(lens))]
    x = torch.randn(sum(lens), cfg.hidden_size, device="cuda", generator=g)
    out = {}
    for label, rows in (("off", 1 << 30), ("on", 257)):
        for name, kind, n, k in GEMMS[:4]:
            if "best" in res["shapes"][name]:
                tk_gemm.BIG_M[(kind, n, k)] = tuple(int(v) for v in res["shapes"][name]["best"].split("x"))
        tk_gemm.BIG_M_MIN_ROWS = rows
        h = prefill_rows_fp32_attention(p.talker, kv, x, lens, blocks)
        kvs = kv.k[:, :200].clone()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            ev[0].record()
            prefill_rows_fp32_attention(p.talker, kv, x, lens, blocks)
            ev[1].record()
            torch.cuda.synchronize()
            times.append(ev[0].elapsed_time(ev[1]))
        out[label] = (h.clone(), kvs, sorted(times)[2])
    res["prefill_4313_rows_ms"] = {"off": round(out["off"][2], 2), "on": round(out["on"][2], 2)}
    res["prefill_bitwise_equal"] = bool(torch.equal(out["off"][0], out["on"][0]) and torch.equal(out["off"][1], out["on"][1]))
    res["big_m"] = {f"{k[0]} {k[1]}x{k[2]}": v for k, v in tk_gemm.BIG_M.items()}
    print("prefill", res["prefill_4313_rows_ms"], "bitwise", res["prefill_bitwise_equal"], flush=True)
    with open(os.path.join(OUT, "gemm_big.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
