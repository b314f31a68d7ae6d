"""GPU experiment: the prefill's many-row products through tk_gemm.gemm_big (x split into bf16
hi / lo once, one program over all K pieces, no partial products) against `_gemm` (the split
inside every output tile; K pieces as partial products). Checks every candidate tile bitwise
against `_gemm` (M = 4096 and M = 1), times both (CUDA graphs), then times eager batched
prefills (4,313 rows: 145 prompts' worth; and fewer) with the switch off and on, bitwise compared.
DTYPE=fp16: the same for fp16 matrices (x rounded once to fp16; tk_gemm.BIG_M_FP16), the
products that the fp16 default kept in fp16 then (q|k|v, o_proj, gate|up; down was bf16 until session 33).

  PYTHONPATH=. python3 scripts/gpu_gemm_big.py   # writes $OUT/gemm_big[_fp16].json
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
FP16 = os.environ.get("DTYPE", "bf16") == "fp16"
# (BLOCK_M, BLOCK_N, warps, stages) by the shape's BLOCK_K (the hi and lo tiles double x's
# shared memory: 228 KB holds 2 stages of 128 x 128 at BLOCK_K 128)
TILES = {128: [(128, 128, 8, 2), (64, 128, 4, 2), (128, 64, 8, 2), (128, 64, 4, 2), (64, 64, 4, 3), (64, 256, 8, 2)],
         64: [(128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3), (128, 64, 4, 4), (64, 128, 4, 4), (256, 128, 8, 2)]}
if FP16:  # one fp16 x tile per stage: (BM + BN) x BLOCK_K x 2 bytes
    TILES = {128: [(128, 128, 8, 3), (128, 128, 4, 3), (128, 256, 8, 2), (256, 128, 8, 2), (64, 128, 4, 3),
                   (128, 64, 4, 3), (64, 256, 8, 2), (128, 128, 8, 2)],
             64: [(128, 128, 8, 4), (128, 256, 8, 3), (256, 128, 8, 3), (128, 128, 4, 4), (64, 128, 4, 4),
                  (128, 64, 4, 4), (128, 128, 8, 3)]}
BIG = tk_gemm.BIG_M_FP16 if FP16 else tk_gemm.BIG_M
TERMS = 0 if FP16 else 2


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name(), "shapes": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.float16 if FP16 else torch.bfloat16
    for name, kind, n, k in GEMMS[:3 if FP16 else 4]:
        sw = kind == "swiglu"
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.03).to(dt)
        w2 = (torch.randn(n, k, device="cuda", generator=g) * 0.03).to(dt) if sw else None
        xs = {m: torch.randn(m, k, device="cuda", generator=g) for m in MS}
        ref = tk_gemm._gemm(xs[4096], w, w2)
        ref1 = tk_gemm._gemm(xs[4096][:1], w, w2)
        entry: dict = {"base_us": {}, "base_parts_us": {}, "tiles": {}}
        for m in MS:
            entry["base_us"][m] = round(bench_graph(lambda i: tk_gemm._gemm(xs[m], w, w2), 4), 1)
            if not sw:
                entry["base_parts_us"][m] = round(bench_graph(lambda i: tk_gemm._gemm(xs[m], w, w2, reduce=False), 4), 1)
        parts = {m: tk_gemm.split_parts(xs[m], TERMS) for m in MS}
        entry["split_us"] = {m: round(bench_graph(lambda i: tk_gemm.split_parts(xs[m], TERMS), 4), 1) for m in MS}
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
    # eager batched prefills of 4,313 rows (145 English prompts' worth) and fewer, switch off / on
    from tts_server.engines.batched.checks import random_weights
    from tts_server.engines.batched.kv_pool import PagedKV
    from tts_server.engines.batched.params import prepare
    from tts_server.engines.batched.prefill import prefill_rows_fp32_attention

    p = prepare(random_weights("cuda"), dtype=torch.float16 if FP16 else torch.bfloat16)
    cfg = p.talker.cfg
    best = {(kind, n, k): tuple(int(v) for v in res["shapes"][name]["best"].split("x"))
            for name, kind, n, k in GEMMS[:4] if "best" in res["shapes"].get(name, {})}
    res["prefill_ms"], res["prefill_bitwise_equal"] = {}, {}
    for rows_total, prompts in ((4313, 145), (2150, 72), (1075, 36)):
        lens = [30 - (i % 7) for i in range(prompts)]
        lens[-1] += rows_total - sum(lens)
        kv = PagedKV(cfg, prompts + 1, 4096, prompts * 2 + 8, 64, torch.bfloat16, torch.device("cuda"))
        for s, n in enumerate(lens):
            assert kv.ensure(s, n)
        kv.sync()
        blocks = [kv.blocks(s) for s in range(len(lens))]
        x = torch.randn(sum(lens), cfg.hidden_size, device="cuda", generator=g)
        out = {}
        for label in ("off", "on"):
            BIG.clear()  # off: no many-row path for this dtype (the bf16 down keeps its default with fp16)
            if label == "on":  # on: the sweep's best tiles from 257 rows
                BIG.update(best)
            setattr(tk_gemm, "BIG_M_FP16_MIN_ROWS" if FP16 else "BIG_M_MIN_ROWS", 257)
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
        res["prefill_ms"][rows_total] = {"off": round(out["off"][2], 2), "on": round(out["on"][2], 2)}
        res["prefill_bitwise_equal"][rows_total] = bool(torch.equal(out["off"][0], out["on"][0])
                                                        and torch.equal(out["off"][1], out["on"][1]))
        print("prefill", rows_total, "rows:", res["prefill_ms"][rows_total], "bitwise",
              res["prefill_bitwise_equal"][rows_total], flush=True)
        del kv
    res["big_m"] = {f"{k[0]} {k[1]}x{k[2]}": v for k, v in best.items()}
    res["gemm_dtype"] = str(p.talker.wqkv[0].dtype)
    with open(os.path.join(OUT, "gemm_big_fp16.json" if FP16 else "gemm_big.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
