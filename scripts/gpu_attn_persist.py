#!/usr/bin/env python
"""Do scripts/attn_persist.cu's persistent split kernels (v1, v2, v3) give the bits of the talker's decode
attention split (tk_attention._attn_split_tc_kernel, bf16 pools of 64-position pages, launched as
paged_attention launches it), and how close to the memory bandwidth does it stream K/V?

  checks  B = 1, 3, 64, 256: lengths 1, 63, 64, 65, 500, 4,096, mixed (checks.mixed_lengths), mixed
          with those edges, 1,000; pages shuffled, pool slots past each row's end NaN (a missed
          zero-fill shows); v1, v2 and v3 at each of their stage counts (v3: and group counts) at
          its occupancy grid and at a 7-block grid; m, l, acc of every used split compared bitwise,
          unused splits must stay unwritten (NaN), and v3's wait flag must stay 0
  timing  B = 16, 64, 256 mixed and 256 at 1,000 positions: the Triton split kernel and its
          loads-only walk (gpu_attn_probe's), v1 at stages 2-4, v2 and v3 at each instantiation (at
          their occupancy grids), the persistent loads-only walk (at v1's grid) at each stage count (graph
          replays, us, K/V GB/s), and the card's copy rate as the ceiling

Prints the counts that differ, writes attn_persist.json to --out, exits 1 if any value differs.
Needs an sm_90 GPU.

  PYTHONPATH=. python3 scripts/gpu_attn_persist.py --out $OUT
  PYTHONPATH=. python3 scripts/gpu_attn_persist.py --quick --out $OUT   (v2 at 2 stages only; gpu_attn_ab.sh)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_attn_probe import _loads_only_kernel  # noqa: E402
from gpu_frame_profile import BLOCK, HD, NH, NKV, attn_inputs, graph_us, log  # noqa: E402
from tts_server.engines.batched import tk_attention as ta  # noqa: E402
from tts_server.engines.batched.checks import mixed_lengths  # noqa: E402

MAX_BLOCKS = 4096 // BLOCK  # the server's 4,096-position tables
STAGES = (2, 3, 4, 6)  # v1's instantiations (the split kernel and the loads-only walk)
STAGES_V2 = (2, 3, 4)  # v2's
V3 = ((6, 4), (5, 4), (6, 3))  # v3's (stages, groups)
TIMED_V1 = (2, 3, 4)  # v1's stage counts timed (st6 only checked)
SCALE = HD ** -0.5
EDGES = (1, 63, 64, 65, 4096, 500)


def build(out: Path) -> ctypes.CDLL:
    so = out / "attn_persist.so"
    subprocess.run(["nvcc", "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-shared", "-gencode",
                    "arch=compute_90a,code=sm_90a", "-o", str(so), str(ROOT / "scripts" / "attn_persist.cu")],
                   check=True)
    lib = ctypes.CDLL(str(so))
    lib.attn_persist_info.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    lib.attn_persist_run.argtypes = ([ctypes.c_void_p] * 8 + [ctypes.c_float] + [ctypes.c_int] * 5
                                     + [ctypes.c_void_p])
    lib.attn_persist_loads_run.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4 + [ctypes.c_void_p]
    lib.attn_persist_v2_info.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    lib.attn_persist_v2_run.argtypes = lib.attn_persist_run.argtypes
    lib.attn_persist_v3_info.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    lib.attn_persist_v3_run.argtypes = ([ctypes.c_void_p] * 8 + [ctypes.c_float] + [ctypes.c_int] * 6
                                        + [ctypes.c_void_p] * 2)
    return lib


def info(lib, stages: int, math: bool, version: int = 1, groups: int = 0) -> dict:
    out = (ctypes.c_int * 5)()
    if version == 3:
        err = lib.attn_persist_v3_info(stages, groups, out)
    else:
        err = lib.attn_persist_info(stages, int(math), out) if version == 1 else lib.attn_persist_v2_info(stages, out)
    assert err == 0, f"CUDA error {err}"
    return dict(blocks_per_sm=out[0], sms=out[1], grid=out[0] * out[1], regs=out[2], local_bytes=out[3],
                smem_bytes=out[4])


def inputs(lengths: list[int], seed: int) -> dict:
    """attn_inputs' pools, table (pages shuffled) and q, with every pool slot that no row holds NaN."""
    b = len(lengths)
    q, kp, vp, bt, lens = attn_inputs(b, lengths, MAX_BLOCKS, seed)
    kp[0], vp[0] = float("nan"), float("nan")  # page 0: the table's entries past each row's pages
    table = bt.cpu()
    for i, n in enumerate(lengths):
        if n % BLOCK:
            last = int(table[i, (n - 1) // BLOCK])
            kp[last, :, n % BLOCK:] = float("nan")
            vp[last, :, n % BLOCK:] = float("nan")
    return dict(q=q, k=kp, v=vp, table=bt, lens=lens, lengths=lengths)


def outputs(b: int) -> tuple:
    """m, l [B, NH, NSPLIT] and acc [B, NH, NSPLIT, HD], all NaN (a value never written shows)."""
    m = torch.full((b, NH, MAX_BLOCKS), float("nan"), device="cuda")
    return m, torch.full_like(m, float("nan")), torch.full((b, NH, MAX_BLOCKS, HD), float("nan"), device="cuda")


def triton_launcher(x: dict, out: tuple):
    """_attn_split_tc_kernel exactly as ops.paged_attention launches it for this B (no PDL)."""
    b = x["q"].shape[0]
    pps, warps = ta.attn_config(2, BLOCK)
    pps = min(pps, triton.next_power_of_2(MAX_BLOCKS))
    nsplit = triton.cdiv(MAX_BLOCKS, pps)
    assert pps == 1 and nsplit == MAX_BLOCKS, (pps, nsplit)
    spp, stages = ta.splits_per_program(b)
    kv_major = b >= ta.KV_MAJOR_MIN_B and os.environ.get("TTS_ATTN_KV_MAJOR", "1") != "0"
    # a tree whose paged_attention walks a row's splits with Z programs in turn (STRIDED) does so here too
    strided = min(ta.strided_programs(b), nsplit) if hasattr(ta, "strided_programs") else 0
    z = strided or triton.cdiv(nsplit, spp)
    grid = (NKV, b, z) if kv_major else (b, NKV, z)
    extra = dict(STRIDED=strided > 0) if hasattr(ta, "strided_programs") else {}
    m, l, acc = out

    def fn():
        ta._attn_split_tc_kernel[grid](x["q"], x["k"], x["v"], x["table"], x["lens"], m, l, acc, float(SCALE),
                                       MAX_BLOCKS, nsplit, NKV=NKV, G=NH // NKV, BLOCK=BLOCK, PPS=pps, HD=HD,
                                       SPP=spp, QR=max(16, triton.next_power_of_2(NH // NKV)), TERMS=ta.TC_TERMS,
                                       STAGES=stages, INTERPRET=False, num_warps=warps, KV_MAJOR=kv_major, GDC=False,
                                       **extra)
    fn.config = dict(grid=list(grid), spp=spp, stages=stages, kv_major=kv_major, warps=warps, strided=strided)
    return fn


def triton_loads_launcher(x: dict):
    """gpu_attn_probe's loads-only Triton walk: the split kernel's programs and pages at this B."""
    b = x["q"].shape[0]
    spp, stages = ta.splits_per_program(b)
    grid = (b, NKV, triton.cdiv(MAX_BLOCKS, spp))
    lo = torch.empty((b, NKV, grid[2], HD), dtype=torch.float32, device="cuda")

    def fn():
        _loads_only_kernel[grid](x["k"], x["v"], x["table"], x["lens"], lo, MAX_BLOCKS, NKV=NKV, BLOCK=BLOCK, PPS=1,
                                 HD=HD, SPP=spp, STAGES=stages, num_warps=4)
    return fn


def persist_launcher(lib, x: dict, out: tuple, stages: int, grid: int, version: int = 1, groups: int = 0):
    """v1 / v2 / v3 (groups) on x into out; v3's wait flag in fn.flag (int32, zeroed here once)."""
    b = x["q"].shape[0]
    m, l, acc = out
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")

    def fn():
        args = (x["q"].data_ptr(), x["k"].data_ptr(), x["v"].data_ptr(), x["table"].data_ptr(), x["lens"].data_ptr(),
                m.data_ptr(), l.data_ptr(), acc.data_ptr(), SCALE, b, MAX_BLOCKS, MAX_BLOCKS, stages)
        stream = torch.cuda.current_stream().cuda_stream
        if version == 3:
            err = lib.attn_persist_v3_run(*args, groups, grid, flag.data_ptr(), stream)
        else:
            err = (lib.attn_persist_run if version == 1 else lib.attn_persist_v2_run)(*args, grid, stream)
        assert err == 0, f"CUDA error {err}"
    fn.flag = flag
    return fn


def loads_launcher(lib, x: dict, stages: int, grid: int):
    b = x["q"].shape[0]
    sink = torch.empty(grid * 128, dtype=torch.int32, device="cuda")

    def fn():
        err = lib.attn_persist_loads_run(x["k"].data_ptr(), x["v"].data_ptr(), x["table"].data_ptr(),
                                         x["lens"].data_ptr(), sink.data_ptr(), b, MAX_BLOCKS, stages, grid,
                                         torch.cuda.current_stream().cuda_stream)
        assert err == 0, f"CUDA error {err}"
    return fn


def compare(ref: tuple, got: tuple, lengths: list[int]) -> dict:
    """Bitwise: the used splits' values that differ; the unused splits' values written (not NaN)."""
    used = torch.arange(MAX_BLOCKS)[None, :] < torch.tensor([-(-n // BLOCK) for n in lengths])[:, None]
    used = used.cuda()
    rec = {}
    for what, a, b in zip(("m", "l", "acc"), ref, got):
        mask = used[:, None, :].expand(a.shape[:3])
        if a.dim() == 4:
            mask = mask[..., None].expand(a.shape)
        au, bu = a[mask], b[mask]
        diff = au.view(torch.int32) != bu.view(torch.int32)
        r = dict(values=int(au.numel()), differ=int(diff.sum()), unused_written=int((~b[~mask].isnan()).sum()),
                 triton_nan=int(au.isnan().sum()))  # should be 0: the inputs' NaN slots are never read
        if diff.any():
            idx = diff.nonzero().flatten()[:4]
            r["first"] = [(float(au[i]), float(bu[i])) for i in idx]
            r["max_rel"] = float(((au - bu).abs() / au.abs().clamp_min(1e-30))[diff].max())
        rec[what] = r
    return rec


def edged(lengths: list[int]) -> list[int]:
    out = list(lengths)
    for k, n in enumerate(EDGES):
        out[k * len(out) // len(EDGES)] = n
    return out


def checks(lib, grids: dict, grids2: dict, grids3: dict, quick: bool = False) -> tuple[dict, int]:
    cases = {f"B1 n={n}": [n] for n in EDGES}
    cases.update({"B3 1,64,65": [1, 64, 65], "B3 63,4096,500": [63, 4096, 500],
                  "B64 mixed": mixed_lengths(64), "B64 mixed+edges": edged(mixed_lengths(64)),
                  "B256 mixed": mixed_lengths(256), "B256 mixed+edges": edged(mixed_lengths(256)),
                  "B256 n=1000": [1000] * 256})
    res, bad = {}, 0
    for seed, (name, lengths) in enumerate(cases.items()):
        x = inputs(lengths, seed)
        b = len(lengths)
        ref = outputs(b)
        tri = triton_launcher(x, ref)
        tri()
        row = {"triton": tri.config}
        runs = ([(1, s, 0, grids[s]) for s in STAGES] + [(1, 3, 0, 7)]
                + [(2, s, 0, grids2[s]) for s in STAGES_V2] + [(2, 2, 0, 7), (2, 3, 0, 7)]
                + [(3, s, ng, grids3[(s, ng)]) for s, ng in V3] + [(3, 6, 4, 7)])
        if quick:  # v2 at 2 stages (the engine's) at its grid and at 7 blocks
            runs = [(2, 2, 0, grids2[2]), (2, 2, 0, 7)]
        for version, stages, groups, grid in runs:
            got = outputs(b)
            fn = persist_launcher(lib, x, got, stages, grid, version, groups)
            fn()
            torch.cuda.synchronize()
            rec = compare(ref, got, lengths)
            flag = int(fn.flag.item())
            key = {1: "", 2: "v2|", 3: f"v3|groups{groups}|"}[version] + f"stages{stages}|grid{grid}"
            row[key] = dict(rec, wait_flag=flag) if version == 3 else rec
            n_bad = sum(v["differ"] + v["unused_written"] for v in rec.values()) + (flag != 0)
            bad += n_bad
            if flag:
                print(f"{name} {key}: wait flag {flag} (a stage wait gave up)", flush=True)
            print(f"{name} {key}: " + ", ".join(
                f"{k} {v['differ']} of {v['values']} differ, {v['unused_written']} unused written"
                + (f", {v['triton_nan']} Triton NaN" if v["triton_nan"] else "")
                for k, v in rec.items()), flush=True)
            for k, v in rec.items():
                if v["differ"]:
                    print(f"   {k}: first (triton, persist) {v['first']}, max rel {v['max_rel']:.3g}", flush=True)
        res[name] = row
        del x
    return res, bad


def timing(lib, grids: dict, grids2: dict, grids3: dict, quick: bool = False) -> dict:
    res = {}
    for b, ctx in ((16, "mixed"), (64, "mixed"), (256, "mixed"), (256, "1000")):
        lengths = mixed_lengths(b) if ctx == "mixed" else [int(ctx)] * b
        x = inputs(lengths, seed=b)
        kv_bytes = sum(lengths) * NKV * HD * 2 * 2
        out = outputs(b)
        fns = {"triton_split": triton_launcher(x, out), "triton_loads_only": triton_loads_launcher(x)}
        for s in TIMED_V1:
            fns[f"persist_st{s}"] = persist_launcher(lib, x, out, s, grids[s])
        for s in STAGES_V2:
            fns[f"v2_st{s}"] = persist_launcher(lib, x, out, s, grids2[s], version=2)
        for s, ng in V3:
            fns[f"v3_st{s}_g{ng}"] = persist_launcher(lib, x, out, s, grids3[(s, ng)], version=3, groups=ng)
        for s in STAGES:
            fns[f"loads_only_st{s}"] = loads_launcher(lib, x, s, grids[s])
        if quick:  # the Triton split, v2 at 2 stages (the engine's), the walk alone at 2 stages
            fns = {k: fns[k] for k in ("triton_split", "v2_st2", "loads_only_st2")}
        row = {"kv_MB": round(kv_bytes / 1e6, 1)}
        for name, fn in fns.items():
            try:
                us = graph_us(fn)
                row[name] = dict(us=round(us, 2), GBps=round(kv_bytes / us / 1e3, 1))
            except Exception as e:  # noqa: BLE001
                row[name] = dict(error=repr(e)[:300])
            if hasattr(fn, "flag") and name.startswith("v3"):
                row[name]["wait_flag"] = int(fn.flag.item())  # nonzero: a wait gave up, the time is not v3's
        res[f"B{b}|{ctx}"] = row
        log(f"B{b}|{ctx}", json.dumps(row))
        del x, out
    return res


def copy_rate() -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write): this card's ceiling."""
    src = torch.empty(2 ** 30 // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    us = graph_us(lambda: dst.copy_(src), reps=5)
    return round(2 * src.numel() * 4 / us / 1e3, 1)


def profile_runs(lib, reps: int = 5) -> None:
    """B = 64 mixed only: the Triton split, v2 (2 stages) and the loads-only walk (2 stages), each
    `reps` times in turn, for Nsight Compute (gpu_attn_persist_ncu.sh) to pick a launch of each."""
    x = inputs(mixed_lengths(64), seed=64)
    out = outputs(64)
    fns = (triton_launcher(x, out), persist_launcher(lib, x, out, 2, info(lib, 2, True, version=2)["grid"], version=2),
           loads_launcher(lib, x, 2, info(lib, 2, False)["grid"]))
    for _ in range(reps):
        for fn in fns:
            fn()
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--profile", action="store_true", help="only profile_runs (no checks, no timing)")
    ap.add_argument("--quick", action="store_true", help="v2 at 2 stages only (the engine's): its checks, "
                    "then the Triton split, v2 and the walk alone timed (A/Bs of decode_split.cuh)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    lib = build(out)
    log("built")
    if a.profile:
        profile_runs(lib)
        return
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "info": {f"stages{s}|{'split' if math else 'loads'}": info(lib, s, math)
                    for s in STAGES for math in (True, False)}}
    res["info"].update({f"v2|stages{s}|split": info(lib, s, True, version=2) for s in STAGES_V2})
    res["info"].update({f"v3|stages{s}|groups{ng}": info(lib, s, True, version=3, groups=ng) for s, ng in V3})
    log(json.dumps(res["info"]))
    grids = {s: res["info"][f"stages{s}|split"]["grid"] for s in STAGES}
    grids2 = {s: res["info"][f"v2|stages{s}|split"]["grid"] for s in STAGES_V2}
    grids3 = {(s, ng): res["info"][f"v3|stages{s}|groups{ng}"]["grid"] for s, ng in V3}
    dump = out / "attn_persist.json"
    res["checks"], bad = checks(lib, grids, grids2, grids3, a.quick)
    res["differ"] = bad
    dump.write_text(json.dumps(res, indent=1))
    log("all bitwise equal" if not bad else f"{bad} values differ")
    res["copy_GBps"] = copy_rate()
    log("copy", res["copy_GBps"], "GB/s")
    res["timing"] = timing(lib, grids, grids2, grids3, a.quick)
    dump.write_text(json.dumps(res, indent=1))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
