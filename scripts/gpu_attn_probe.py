#!/usr/bin/env python
"""Where the talker's decode attention spends its time at large B (issue 16): the tensor-core
split kernel and its combine timed apart, against a kernel that walks the same programs and pages
but only loads K/V (the access pattern's own memory bound) and the split kernel with 3 instead of 2
bf16 parts (its tensor-core share); with --sections spp, splits per program and stages at
B = 4..128; with --sections walk, what holds the B = 64 walk back; with --sections strided,
programs striding over a row's splits. Graph replays, median us per layer, K/V GB/s.

  PYTHONPATH=. python3 scripts/gpu_attn_probe.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_frame_profile import BLOCK, HD, NH, NKV, attn_inputs, graph_us, log  # noqa: E402
from tts_server.engines.batched import ops, tk_attention as ta  # noqa: E402
from tts_server.engines.batched.checks import mixed_lengths  # noqa: E402


@triton.jit
def _loads_only_kernel(k_ptr, v_ptr, bt_ptr, len_ptr, out_ptr, MAX_BLOCKS, NKV: tl.constexpr,
                       BLOCK: tl.constexpr, PPS: tl.constexpr, HD: tl.constexpr, SPP: tl.constexpr,
                       STAGES: tl.constexpr):
    # the split kernel's programs and page walk; K/V only summed (no dots, no softmax)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    c = tl.program_id(2)
    n = tl.load(len_ptr + b)
    SPLIT_LEN: tl.constexpr = PPS * BLOCK
    used = (n + SPLIT_LEN - 1) // SPLIT_LEN
    first = c * SPP
    if first >= used:
        return
    d = tl.arange(0, HD)
    j = tl.arange(0, SPLIT_LEN)
    acc = tl.zeros((HD,), tl.float32)
    for sp in tl.range(first, tl.minimum(first + SPP, used), num_stages=STAGES):
        pos = sp * SPLIT_LEN + j
        pmask = pos < n
        page = tl.load(bt_ptr + b * MAX_BLOCKS + sp * PPS + j // BLOCK, mask=pmask, other=0)
        row_off = ((page.to(tl.int64) * NKV + kvh) * BLOCK + j % BLOCK) * HD
        k = tl.load(k_ptr + row_off[:, None] + d[None, :], mask=pmask[:, None], other=0.0)
        v = tl.load(v_ptr + row_off[:, None] + d[None, :], mask=pmask[:, None], other=0.0)
        acc += tl.sum(k.to(tl.float32) + v.to(tl.float32), axis=0)
    tl.store(out_ptr + ((b * NKV + kvh) * tl.num_programs(2) + c) * HD + d, acc)


def run_case(b: int, ctx: str) -> dict:
    lengths = mixed_lengths(b) if ctx == "mixed" else [int(ctx)] * b
    max_blocks = 4096 // BLOCK
    q, kp, vp, bt, lens = attn_inputs(b, lengths, max_blocks, seed=b)
    kv_bytes = sum(lengths) * NKV * HD * 2 * 2
    pps, warps = ta.attn_config(2, BLOCK)
    pps = min(pps, triton.next_power_of_2(max_blocks))
    nsplit = triton.cdiv(max_blocks, pps)
    spp, stages = ta.splits_per_program(b)
    m = torch.empty((b, NH, nsplit), dtype=torch.float32, device="cuda")
    l = torch.empty_like(m)
    acc = torch.empty((b, NH, nsplit, HD), dtype=torch.float32, device="cuda")
    out = torch.empty((b, NH, HD), dtype=torch.float32, device="cuda")
    grid = (b, NKV, triton.cdiv(nsplit, spp))
    qr = max(16, triton.next_power_of_2(NH // NKV))

    def split(terms=ta.TC_TERMS, spp_=spp, stages_=stages, kv_major=False):
        g = (NKV, b, triton.cdiv(nsplit, spp_)) if kv_major else (b, NKV, triton.cdiv(nsplit, spp_))
        ta._attn_split_tc_kernel[g](q, kp, vp, bt, lens, m, l, acc, 0.088, max_blocks, nsplit, NKV=NKV,
                                    G=NH // NKV, BLOCK=BLOCK, PPS=pps, HD=HD, SPP=spp_, QR=qr, TERMS=terms,
                                    STAGES=stages_, INTERPRET=False, num_warps=warps, GDC=False, KV_MAJOR=kv_major)

    def combine():
        ta._attn_combine_kernel[(b, NH)](m, l, acc, lens, out, NH, nsplit, SPLIT_LEN=pps * BLOCK, HD=HD,
                                         HD_P2=HD, num_warps=1, GDC=False)

    lo = torch.empty((b, NKV, grid[2], HD), dtype=torch.float32, device="cuda")

    def loads(stages_=stages, warps_=warps):
        _loads_only_kernel[grid](kp, vp, bt, lens, lo, max_blocks, NKV=NKV, BLOCK=BLOCK, PPS=pps, HD=HD, SPP=spp,
                                 STAGES=stages_, num_warps=warps_)

    row = {}
    for name, fn in (("full", lambda: ops.paged_attention(q, kp, vp, bt, lens, 0.088)), ("split", split), ("split_kv_major", lambda: split(kv_major=True)),
                     ("combine", combine), ("split_3terms", lambda: split(3)), ("loads_only", loads),
                     ("loads_only_3stages", lambda: loads(3)), ("loads_only_8warps", lambda: loads(2, 8)),
                     ("split_spp1", lambda: split(spp_=1, stages_=1))):
        try:
            us = graph_us(fn)
            row[name] = dict(us=round(us, 2), GBps=round(kv_bytes / us / 1e3, 1))
        except Exception as e:  # noqa: BLE001
            row[name] = dict(error=repr(e)[:300])
    row["kv_MB"] = round(kv_bytes / 1e6, 1)
    row["grid"] = list(grid)
    return row


def cp_attend_case() -> dict:
    """The code predictor's fused attention (tk_glue.cp_attend at position 8, cp_attend0) at M = 1 /
    16 / 64 / 256 streams, as launched and with a register cap (maxnreg; more programs resident,
    the same instructions' results), each checked bitwise against the default launch."""
    from tts_server.engines.batched import tk_glue as tg

    g = torch.Generator(device="cuda").manual_seed(3)
    nh, nkv, hd = 16, 8, 128
    qn, kn = 1 + 0.1 * torch.randn(hd, device="cuda", generator=g), 1 + 0.1 * torch.randn(hd, device="cuda", generator=g)
    cos, sin = torch.randn(16, hd, device="cuda", generator=g), torch.randn(16, hd, device="cuda", generator=g)
    out = {}
    for m in (1, 16, 64, 256):
        qkv = torch.randn(2 * m, (nh + 2 * nkv) * hd, device="cuda", generator=g)
        kp, vp = (torch.randn(m, nkv, 16, hd, device="cuda", generator=g) for _ in range(2))
        row = {}
        for name, fn in (("pos8", lambda **kw: tg.cp_attend(qkv[:m], qn, kn, cos[8:9], sin[8:9], kp, vp, 8, nh, nkv,
                                                               1e-6, 0.088, **kw)),
                         ("pass0", lambda **kw: tg.cp_attend0(qkv, qn, kn, cos[:2], sin[:2], kp, vp, nh, nkv, 1e-6,
                                                              0.088, **kw))):
            ref = fn()
            for cap in (None, 128, 96, 64):
                kw = {} if cap is None else {"maxnreg": cap}
                key = f"{name}|maxnreg{cap}"
                try:
                    same = torch.equal(fn(**kw), ref)
                    row[key] = round(graph_us(lambda: fn(**kw)), 2) if same else "NOT EQUAL"
                except Exception as e:  # noqa: BLE001
                    row[key] = repr(e)[:160]
        out[m] = row
        log(f"cp_attend M={m}", json.dumps(row))
    return out


def spp_case() -> dict:
    """The decode attention (split + merge, ops.paged_attention) at B = 4..128, mixed contexts,
    4,096-position tables (the server's default), with each (splits per program, stages): graph
    replay us, each output checked bitwise against the default's."""
    out = {}
    default, default_stride = ta.SPP_BY_B, ta.STRIDE_BY_B
    ta.STRIDE_BY_B = ((1 << 30, 0),)  # SPP runs
    try:
        for b in (4, 8, 16, 32, 64, 128):
            lengths = mixed_lengths(b)
            q, kp, vp, bt, lens = attn_inputs(b, lengths, 4096 // BLOCK, seed=b)
            ta.SPP_BY_B = default
            ref = ops.paged_attention(q, kp, vp, bt, lens, 0.088)
            row = {"default": list(ta.splits_per_program(b))}
            for spp, stages in ((1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (8, 2)):
                ta.SPP_BY_B = ((1 << 30, spp, stages),)
                same = torch.equal(ops.paged_attention(q, kp, vp, bt, lens, 0.088), ref)
                us = graph_us(lambda: ops.paged_attention(q, kp, vp, bt, lens, 0.088))
                row[f"spp{spp}_st{stages}"] = round(us, 2) if same else "NOT EQUAL"
            out[b] = row
            log(f"spp B={b}", json.dumps(row))
    finally:
        ta.SPP_BY_B, ta.STRIDE_BY_B = default, default_stride
    return out


def walk_case() -> dict:
    """What holds the B = 64 mixed decode attention at ~2.9 TB/s (ncu, session 43: both the split
    kernel and its loads-only walk, at 3 and 6 programs an SM): the loads-only walk and the split
    kernel with the grid's programs that find no split cut off (z = the longest row's programs
    instead of the table's), with the pages in order instead of shuffled, with every row 500
    long (no raggedness), and with other splits per program. us per layer, K/V GB/s."""
    b = 64
    out = {}
    pps, warps = ta.attn_config(2, BLOCK)
    max_blocks = 4096 // BLOCK
    nsplit = triton.cdiv(max_blocks, pps)
    qr = max(16, triton.next_power_of_2(NH // NKV))
    for label, lengths, shuffle in (("mixed", mixed_lengths(b), True), ("mixed_in_order", mixed_lengths(b), False),
                                    ("all500", [500] * b, True)):
        q, kp, vp, bt, lens = attn_inputs(b, lengths, max_blocks, seed=b)
        if not shuffle:
            need = [-(-n // BLOCK) for n in lengths]
            at = 1
            for i, k in enumerate(need):
                bt[i, :k] = torch.arange(at, at + k, dtype=torch.int32, device="cuda")
                at += k
        kv_bytes = sum(lengths) * NKV * HD * 2 * 2
        m = torch.empty((b, NH, nsplit), dtype=torch.float32, device="cuda")
        l = torch.empty_like(m)
        acc = torch.empty((b, NH, nsplit, HD), dtype=torch.float32, device="cuda")
        used = -(-max(lengths) // (pps * BLOCK))
        row = {}
        for spp, stages in ((4, 2), (1, 1), (2, 2), (8, 2), (16, 2)):
            for cut in (False, True):
                z = triton.cdiv(used if cut else nsplit, spp)
                lo = torch.empty((b, NKV, z, HD), dtype=torch.float32, device="cuda")

                def loads():
                    _loads_only_kernel[(b, NKV, z)](kp, vp, bt, lens, lo, max_blocks, NKV=NKV, BLOCK=BLOCK, PPS=pps,
                                                    HD=HD, SPP=spp, STAGES=stages, num_warps=warps)

                def split():
                    ta._attn_split_tc_kernel[(b, NKV, z)](q, kp, vp, bt, lens, m, l, acc, 0.088, max_blocks, nsplit,
                                                         NKV=NKV, G=NH // NKV, BLOCK=BLOCK, PPS=pps, HD=HD, SPP=spp,
                                                         QR=qr, TERMS=ta.TC_TERMS, STAGES=stages, INTERPRET=False,
                                                         num_warps=warps, GDC=False, KV_MAJOR=False)
                for name, fn in (("loads", loads), ("split", split)):
                    key = f"{name}|spp{spp}_st{stages}|z{z}"
                    try:
                        us = graph_us(fn)
                        row[key] = dict(us=round(us, 2), GBps=round(kv_bytes / us / 1e3, 1))
                    except Exception as e:  # noqa: BLE001
                        row[key] = dict(error=repr(e)[:200])
        out[label] = row
        log(f"walk {label}", json.dumps(row))
    return out


def strided_case() -> dict:
    """The split kernel with its programs striding over a row's splits (STRIDED: program c takes
    splits c, c + Z, ...) against the default (SPP consecutive splits a program), at B = 1..256
    mixed and B = 256 at 1,000 positions, 4,096-position tables: split + merge us (graph replays),
    each merged output checked bitwise against the default's."""
    out = {}
    pps, warps = ta.attn_config(2, BLOCK)
    max_blocks = 4096 // BLOCK
    nsplit = triton.cdiv(max_blocks, pps)
    qr = max(16, triton.next_power_of_2(NH // NKV))
    for b, ctx in ((1, "mixed"), (16, "mixed"), (32, "mixed"), (64, "mixed"), (128, "mixed"), (256, "mixed"),
                   (256, "1000")):
        lengths = mixed_lengths(b) if ctx == "mixed" else [int(ctx)] * b
        q, kp, vp, bt, lens = attn_inputs(b, lengths, max_blocks, seed=b)
        kv_bytes = sum(lengths) * NKV * HD * 2 * 2
        ref = ops.paged_attention(q, kp, vp, bt, lens, 0.088)
        m = torch.empty((b, NH, nsplit), dtype=torch.float32, device="cuda")
        l = torch.empty_like(m)
        acc = torch.empty((b, NH, nsplit, HD), dtype=torch.float32, device="cuda")
        o = torch.empty((b, NH, HD), dtype=torch.float32, device="cuda")
        row = {"default": round(graph_us(lambda: ops.paged_attention(q, kp, vp, bt, lens, 0.088)), 2),
               "default_spp": list(ta.splits_per_program(b))}
        for z in (4, 8, 16, 32):
            for stages in (1, 2):
                for kv_major in ((False, True) if b >= 128 else (False,)):
                    def run():
                        g = (NKV, b, z) if kv_major else (b, NKV, z)
                        ta._attn_split_tc_kernel[g](q, kp, vp, bt, lens, m, l, acc, 0.088, max_blocks, nsplit, NKV=NKV,
                                                    G=NH // NKV, BLOCK=BLOCK, PPS=pps, HD=HD, SPP=1, QR=qr,
                                                    TERMS=ta.TC_TERMS, STAGES=stages, INTERPRET=False, num_warps=warps,
                                                    GDC=False, KV_MAJOR=kv_major, STRIDED=True)
                        ta._attn_combine_kernel[(b, NH)](m, l, acc, lens, o, NH, nsplit, SPLIT_LEN=pps * BLOCK, HD=HD,
                                                         HD_P2=HD, num_warps=1, GDC=False)
                    key = f"z{z}_st{stages}" + ("_kvmajor" if kv_major else "")
                    try:
                        run()
                        same = torch.equal(o, ref)
                        us = graph_us(run)
                        row[key] = round(us, 2) if same else f"NOT EQUAL ({us:.2f})"
                    except Exception as e:  # noqa: BLE001
                        row[key] = repr(e)[:200]
        row["kv_MB"] = round(kv_bytes / 1e6, 1)
        out[f"B{b}|{ctx}"] = row
        log(f"strided B{b}|{ctx}", json.dumps(row))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--sections", default="decode,cp")
    a = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    if "cp" in a.sections.split(","):
        res["cp_attend"] = cp_attend_case()
    if "spp" in a.sections.split(","):
        res["spp"] = spp_case()
    if "walk" in a.sections.split(","):
        res["walk"] = walk_case()
    if "strided" in a.sections.split(","):
        res["strided"] = strided_case()
    if "decode" not in a.sections.split(","):
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "attn_probe_parts.json").write_text(json.dumps(res, indent=1))
        return
    # the copy rate of this card, as the ceiling
    x = torch.empty(2 ** 30 // 4, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    us = graph_us(lambda: y.copy_(x), reps=5)
    res["copy_GBps"] = round(2 * x.numel() * 4 / us / 1e3, 1)
    log("copy", res["copy_GBps"], "GB/s")
    del x, y
    for b, ctx in ((64, "mixed"), (256, "mixed"), (256, "1000")):
        res[f"B{b}|{ctx}"] = run_case(b, ctx)
        log(f"B{b}|{ctx}", json.dumps(res[f"B{b}|{ctx}"]))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "attn_probe.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
