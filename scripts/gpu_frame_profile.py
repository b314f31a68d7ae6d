#!/usr/bin/env python
"""Where a batched frame's GPU time goes, and the decode attention's variants, in one call:

  attention  ops.paged_attention alone at B 1 / 64 / 256, contexts mixed (mean 500) and 1000,
             CUDA-core split kernel vs the tensor-core one (splits per program, warps swept):
             median us of graph replays, KV GB/s; max error vs an fp64 reference; the tensor-core
             kernel's bits across splits-per-program values (must be equal)
  frames     graph-replay frame time at B 1 / 8 / 64 / 256 (mixed contexts; 256 also at 1000)
             with each attention kernel
  profile    one eager frame at B 1 / 64 / 256 (PROFILE_SIZES) under the torch profiler: GPU time
             per (kernel, grid), largest first

  PYTHONPATH=. python3 scripts/gpu_frame_profile.py --out $OUT [--sections attention,frames,profile]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_batched_engine import fake_admit  # noqa: E402
from tts_server.engines.batched.checks import mixed_lengths  # noqa: E402

from tts_server.engines.batched import checks, ops, ops_ref, tk_attention  # noqa: E402
from tts_server.engines.batched.engine import BatchedEngine  # noqa: E402
from tts_server.engines.batched.graphs import StepGraphs  # noqa: E402

T0 = time.perf_counter()
NH, NKV, HD, BLOCK = 16, 8, 128, 64


def log(*a) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, flush=True)


def graph_us(fn, reps: int = 20) -> float:
    """Median us of one call of fn, captured in a CUDA graph `reps` times and replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    ts = []
    for _ in range(7):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / reps)
    return float(np.median(ts))


def attn_inputs(b: int, lengths: list[int], max_blocks: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    need = [-(-n // BLOCK) for n in lengths]
    nblocks = sum(need) + 1
    kp = torch.randn(nblocks, NKV, BLOCK, HD, device="cuda", generator=g).bfloat16()
    vp = torch.randn(nblocks, NKV, BLOCK, HD, device="cuda", generator=g).bfloat16()
    perm = torch.randperm(nblocks - 1, device="cuda", generator=g) + 1
    bt = torch.zeros(b, max_blocks, dtype=torch.int32, device="cuda")
    at = 0
    for i, k in enumerate(need):
        bt[i, :k] = perm[at:at + k].int()
        at += k
    q = torch.randn(b, NH, HD, device="cuda", generator=g)
    return q, kp, vp, bt, torch.tensor(lengths, dtype=torch.int32, device="cuda")


def attention() -> dict:
    res: dict = {"cases": {}}
    default_spp, default_stride = tk_attention.SPP_BY_B, tk_attention.STRIDE_BY_B
    variants = [("cuda_cores", False, None, 64, 4, 1)]
    sweep = ((64, (1, 4, 8), (4,), (1, 2, 3)), (128, (1, 2, 4), (4, 8), (1, 2)))
    if os.environ.get("ATTN_SWEEP") == "long":  # longer walks per program at 64-position splits
        sweep = ((64, (8, 16, 32), (4, 8), (2, 3)),)
    if os.environ.get("ATTN_SWEEP") == "default":  # the tree's own configuration only (A/Bs of trees)
        variants.append(("tc_default", True, None, 64, 4, None))
        sweep = ()
    for split, spps, warps_list, stages_list in sweep:
        for spp in spps:
            for warps in warps_list:
                for stages in stages_list:
                    variants.append((f"tc_pos{split}_spp{spp}_w{warps}_st{stages}", True, spp, split, warps, stages))
    for max_blocks in (64,):  # max_positions 4096 (the server's default)
        for b, ctx in ((1, "mixed"), (1, "1000"), (64, "mixed"), (64, "1000"), (256, "mixed"), (256, "1000")):
            lengths = mixed_lengths(b) if ctx == "mixed" else [int(ctx)] * b
            q, kp, vp, bt, lens = attn_inputs(b, lengths, max_blocks, seed=b)
            kv_bytes = sum(lengths) * NKV * HD * 2 * 2
            row = {}
            for name, tc, spp, split, warps, stages in variants:
                tk_attention.TENSOR_CORES = tc
                tk_attention.OVERRIDE[2] = (split, warps)
                tk_attention.STRIDE_BY_B = default_stride
                if spp is not None:  # SPP runs (the strided walk off)
                    tk_attention.SPP_BY_B = ((1 << 30, spp, stages),)
                    tk_attention.STRIDE_BY_B = ((1 << 30, 0),)
                try:
                    us = graph_us(lambda: ops.paged_attention(q, kp, vp, bt, lens, 0.088))
                    row[name] = dict(us=round(us, 2), GBps=round(kv_bytes / us / 1e3, 1))
                except Exception as e:
                    row[name] = dict(error=repr(e)[:300])
            key = f"B{b}|{ctx}|max_blocks{max_blocks}"
            res["cases"][key] = row
            best = min((v["us"], k) for k, v in row.items() if "us" in v)
            log(key, "cuda cores", row["cuda_cores"], "best", best)
    tk_attention.OVERRIDE.pop(2, None)
    tk_attention.SPP_BY_B, tk_attention.STRIDE_BY_B = default_spp, default_stride
    # accuracy vs fp64 and bits across SPP, on a mixed batch of 17 rows (one empty)
    lengths = [0] + mixed_lengths(16)
    q, kp, vp, bt, lens = attn_inputs(17, lengths, 32, seed=5)
    ref = ops_ref.paged_attention(q, kp, vp, bt, lens, 0.088)
    acc = {}
    outs = []
    for name, tc, spp, st in (("cuda_cores", False, 1, 1), ("tc_spp1", True, 1, 1), ("tc_spp4_st2", True, 4, 2),
                              ("tc_spp8_st2", True, 8, 2), ("tc_spp8_st1", True, 8, 1)):
        tk_attention.TENSOR_CORES = tc
        tk_attention.SPP_BY_B, tk_attention.STRIDE_BY_B = ((1 << 30, spp, st),), ((1 << 30, 0),)
        out = ops.paged_attention(q, kp, vp, bt, lens, 0.088)
        acc[name] = float((out - ref).abs().max() / ref.abs().max())
        if tc:
            outs.append(out)
    acc["tc_bitwise_across_spp"] = all(torch.equal(outs[0], o) for o in outs[1:])
    # one row alone vs inside B = 64 (SPP 1 vs 4 by the default table)
    tk_attention.TENSOR_CORES = True
    tk_attention.SPP_BY_B, tk_attention.STRIDE_BY_B = default_spp, default_stride
    q64, kp64, vp64, bt64, lens64 = attn_inputs(64, mixed_lengths(64), 32, seed=6)
    full = ops.paged_attention(q64, kp64, vp64, bt64, lens64, 0.088)
    alone = ops.paged_attention(q64[7:8], kp64, vp64, bt64[7:8], lens64[7:8], 0.088)
    acc["tc_row_alone_equals_in_b64"] = bool(torch.equal(full[7], alone[0]))
    res["accuracy"] = acc
    log("accuracy", acc)
    return res


def frames(w) -> dict:
    res = {}
    eng = BatchedEngine(w, max_streams=256, max_positions=2048, num_blocks=256 * 17 + 1, use_graphs=False)
    for name, tc in (("tensor_cores", True), ("cuda_cores", False)):
        tk_attention.TENSOR_CORES = tc
        t = time.perf_counter()
        graphs = StepGraphs(eng.frame, [1, 8, 64, 256], eng.state.scratch)
        log(f"{name}: captured in {time.perf_counter() - t:.1f} s")
        for b, ctx in ((1, "mixed"), (8, "mixed"), (64, "mixed"), (256, "mixed"), (256, "1000"), (64, "1000")):
            lengths = mixed_lengths(b) if ctx == "mixed" else [int(ctx)] * b
            slots = fake_admit(eng, lengths, margin=64)
            graphs.rows[:b].copy_(torch.tensor(slots, device="cuda"))
            eng.kv.sync()
            for _ in range(3):
                graphs.replay(b)
            ts = []
            for _ in range(20):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                graphs.replay(b)
                e1.record()
                torch.cuda.synchronize()
                ts.append(e0.elapsed_time(e1))
            ms = float(np.median(ts))
            res[f"{name}|B{b}|{ctx}"] = round(ms, 3)
            log(f"{name} B {b} {ctx}: {ms:.3f} ms")
        del graphs
        torch.cuda.empty_cache()
    tk_attention.TENSOR_CORES = True
    return res


def profile(w) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    eng = BatchedEngine(w, max_streams=256, max_positions=2048, num_blocks=256 * 17 + 1, use_graphs=False)
    out = {}
    for b in [int(x) for x in os.environ.get("PROFILE_SIZES", "1,64,256").split(",")]:
        slots = fake_admit(eng, mixed_lengths(b), margin=8)
        rows = torch.tensor(slots, device="cuda")
        eng.kv.sync()
        eng.frame(rows)
        torch.cuda.synchronize()
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            eng.frame(rows)
            torch.cuda.synchronize()
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            p.export_chrome_trace(f.name)
            trace = json.load(open(f.name))
        groups: dict = defaultdict(lambda: [0, 0.0])
        total, count = 0.0, 0
        for e in trace.get("traceEvents", []):
            if e.get("cat") != "kernel":
                continue
            a = e.get("args", {})
            key = f"{e['name'][:60]} grid={a.get('grid')} block={a.get('block')}"
            groups[key][0] += 1
            groups[key][1] += e.get("dur", 0.0)
            total += e.get("dur", 0.0)
            count += 1
        top = sorted(groups.items(), key=lambda kv: -kv[1][1])[:30]
        out[f"B{b}"] = dict(kernels=count, gpu_us=round(total, 1),
                            top=[(k, n, round(us, 1)) for k, (n, us) in top])
        log(f"profile B {b} mixed: {count} kernels, {total:.0f} us")
        for k, n, us in out[f"B{b}"]["top"][:18]:
            log(f"    {us:8.1f} us {n:4d}x  {k}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--sections", default="attention,frames,profile")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import triton

    res: dict = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                     date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    w = None
    for name in args.sections.split(","):
        log("==", name)
        try:
            if name != "attention" and w is None:
                w = checks.random_weights("cuda")
            res[name] = attention() if name == "attention" else frames(w) if name == "frames" else profile(w)
        except Exception:
            res[name] = dict(error=traceback.format_exc())
            log(res[name]["error"])
        (out / "frame_profile.json").write_text(json.dumps(res, indent=1, default=str))
        gc.collect()
        torch.cuda.empty_cache()
    log("done")


if __name__ == "__main__":
    main()
