#!/usr/bin/env python
"""Do scripts/attn_split_twin.cu's twins give the bits of the talker's decode attention split
(tk_attention._attn_split_tc_kernel, bf16 pools) and of its merge (_attn_combine_kernel, fp16
out)? Both run on the same inputs (rows at lengths that end inside a page, on a split's edge and
past several splits, pages in a shuffled order), the Triton kernel at one split a program and
again at B = 64's configuration (4 splits a program,
2 stages: the same bits by design), then m, l and acc of every used split compared bitwise, and
the merged fp16 rows: the twin's merge of the Triton splits, and the twins end to end; and the
q / k norm + RoPE + K/V store before them (tk_glue._qk_rope_store_kernel) against its twin.
Prints the counts that differ (and the first few), exits 1 if any does. Needs a GPU (sm_90).

  PYTHONPATH=. python3 scripts/gpu_attn_twin.py [--out $OUT]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tts_server.engines.batched import tk_attention as ta  # noqa: E402

NKV, G, HD, BLOCK, MAX_BLOCKS = 8, 2, 128, 16, 128  # the talker's kv heads, pages of 16, 2,048 positions
PPS = 4  # 64-position splits


def build(out: Path) -> ctypes.CDLL:
    so = out / "attn_split_twin.so"
    subprocess.run(["nvcc", "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-shared", "-gencode",
                    "arch=compute_90a,code=sm_90a", "-o", str(so), str(ROOT / "scripts" / "attn_split_twin.cu")],
                   check=True)
    lib = ctypes.CDLL(str(so))
    lib.attn_split_twin_run.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_float] + [ctypes.c_int] * 4 + [ctypes.c_void_p]
    lib.attn_combine_twin_run.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 3 + [ctypes.c_void_p]
    lib.qk_rope_store_twin_run.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int] + [ctypes.c_void_p] * 5
                                           + [ctypes.c_float] + [ctypes.c_int] * 3 + [ctypes.c_void_p])
    return lib


def check_rope_store(lib, rows: int = 5, seed: int = 7) -> dict:
    """tk_glue._qk_rope_store_kernel against its twin: q [M, NH, HD] fp32 and the K/V rows it stores
    (bf16 pools), at positions with their own RoPE rows, bitwise."""
    from tts_server.engines.batched import tk_glue

    gen = torch.Generator(device="cuda").manual_seed(seed)
    nh, eps = NKV * G, 1e-6
    qkv = torch.randn(rows, (nh + 2 * NKV) * HD, device="cuda", generator=gen) * 3.0
    qn = 1.0 + 0.1 * torch.randn(HD, device="cuda", generator=gen)
    kn = 1.0 + 0.1 * torch.randn(HD, device="cuda", generator=gen)
    pos = torch.randint(0, 2048, (rows,), device="cuda", generator=gen).float()
    inv = 1e6 ** (-torch.arange(0, HD, 2, device="cuda").float() / HD)
    ang = pos[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], 1).contiguous(), torch.cat([ang.sin(), ang.sin()], 1).contiguous()
    pages = rows + 3
    blk = torch.randperm(pages, device="cuda", generator=gen)[:rows].long()
    off = torch.randint(0, BLOCK, (rows,), device="cuda", generator=gen).long()
    pools = [torch.zeros(pages, NKV, BLOCK, HD, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    q_ref = torch.full((rows, nh, HD), float("nan"), device="cuda")
    tk_glue._qk_rope_store_kernel[(rows, nh + NKV)](qkv, qn, kn, cos, sin, cos.stride(0), q_ref, pools[0], pools[1],
                                                    blk, off, eps, NH=nh, NKV=NKV, BS=BLOCK, HALF=HD // 2, GDC=False)
    q_twin = torch.full_like(q_ref, float("nan"))
    err = lib.qk_rope_store_twin_run(qkv.data_ptr(), qn.data_ptr(), kn.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                     cos.stride(0), q_twin.data_ptr(), pools[2].data_ptr(), pools[3].data_ptr(),
                                     blk.data_ptr(), off.data_ptr(), eps, rows, nh, NKV,
                                     torch.cuda.current_stream().cuda_stream)
    assert err == 0, f"CUDA error {err}"
    rec = {}
    for what, a, b in (("q", q_ref, q_twin), ("K pool", pools[0], pools[2]), ("V pool", pools[1], pools[3])):
        ints = torch.int32 if a.dtype == torch.float32 else torch.int16
        diff = a.view(ints) != b.view(ints)
        rec[what] = dict(values=int(a.numel()), differ=int(diff.sum()))
    print("q / k norm + RoPE + store: " + ", ".join(f"{k} {v['differ']} of {v['values']} differ"
                                                    for k, v in rec.items()), flush=True)
    return rec


def triton_combine(split: tuple, lens: torch.Tensor) -> torch.Tensor:
    m, l, acc = split
    b, nh, nsplit = m.shape
    out = torch.full((b, nh, HD), float("nan"), dtype=torch.float16, device="cuda")
    ta._attn_combine_kernel[(b, nh)](m, l, acc, lens, out, nh, nsplit, SPLIT_LEN=PPS * BLOCK, HD=HD, HD_P2=HD,
                                     num_warps=1, GDC=False)
    return out


def twin_combine(lib, split: tuple, lens: torch.Tensor) -> torch.Tensor:
    m, l, acc = split
    b, nh, nsplit = m.shape
    out = torch.full((b, nh, HD), float("nan"), dtype=torch.float16, device="cuda")
    err = lib.attn_combine_twin_run(m.data_ptr(), l.data_ptr(), acc.data_ptr(), lens.data_ptr(), out.data_ptr(), b,
                                    nh, nsplit, torch.cuda.current_stream().cuda_stream)
    assert err == 0, f"CUDA error {err}"
    return out


def compare_out(name: str, a: torch.Tensor, b: torch.Tensor) -> dict:
    diff = a.view(torch.int16) != b.view(torch.int16)
    rec = {"out": dict(values=int(a.numel()), differ=int(diff.sum()))}
    if diff.any():
        idx = diff.flatten().nonzero().flatten()[:4]
        rec["out"]["first"] = [(float(a.flatten()[i]), float(b.flatten()[i])) for i in idx]
        rec["out"]["max_rel"] = float(((a.float() - b.float()).abs() / a.float().abs().clamp_min(1e-30))[diff].max())
    print(f"{name}: out {rec['out']['differ']} of {rec['out']['values']} differ", flush=True)
    if diff.any():
        print(f"   out: first (triton, twin) {rec['out']['first']}, max rel {rec['out']['max_rel']:.3g}")
    return rec


def inputs(lens: list[int], seed: int = 0) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    b = len(lens)
    pages = b * MAX_BLOCKS + 1
    kp = (torch.randn(pages, NKV, BLOCK, HD, device="cuda", generator=gen) * 1.5).to(torch.bfloat16)
    vp = torch.randn(pages, NKV, BLOCK, HD, device="cuda", generator=gen).to(torch.bfloat16)
    # pages past a row's length hold NaN: a twin that reads them (instead of zeros) shows
    table = torch.randperm(pages - 1, device="cuda", generator=gen)[:b * MAX_BLOCKS].view(b, MAX_BLOCKS).int() + 1
    for i, n in enumerate(lens):
        last = table[i, (n - 1) // BLOCK]
        kp[last, :, (n - 1) % BLOCK + 1:] = float("nan")
        vp[last, :, (n - 1) % BLOCK + 1:] = float("nan")
    # q after its norm and RoPE: O(1) values, the two query heads of each kv head
    q = torch.randn(b, NKV * G, HD, device="cuda", generator=gen) * 2.0
    return dict(q=q, k=kp, v=vp, table=table, lens=torch.tensor(lens, dtype=torch.int32, device="cuda"))


def split_outputs(b: int) -> tuple:
    """m, l [B, NH, NSPLIT] and acc [B, NH, NSPLIT, HD], all NaN (a value never written shows)."""
    nsplit = MAX_BLOCKS // PPS
    m = torch.full((b, NKV * G, nsplit), float("nan"), device="cuda")
    return m, torch.full_like(m, float("nan")), torch.full((b, NKV * G, nsplit, HD), float("nan"), device="cuda")


def triton_split(x: dict, scale: float, spp: int, stages: int) -> tuple:
    b, nsplit = x["q"].shape[0], MAX_BLOCKS // PPS
    m, l, acc = split_outputs(b)
    ta._attn_split_tc_kernel[(b, NKV, -(-nsplit // spp))](
        x["q"], x["k"], x["v"], x["table"], x["lens"], m, l, acc, scale, MAX_BLOCKS, nsplit, NKV=NKV, G=G,
        BLOCK=BLOCK, PPS=PPS, HD=HD, SPP=spp, QR=16, TERMS=2, STAGES=stages, INTERPRET=False, num_warps=4,
        GDC=False, KV_MAJOR=False)
    return m, l, acc


def twin_split(lib, x: dict, scale: float) -> tuple:
    b, nsplit = x["q"].shape[0], MAX_BLOCKS // PPS
    m, l, acc = split_outputs(b)
    err = lib.attn_split_twin_run(x["q"].data_ptr(), x["k"].data_ptr(), x["v"].data_ptr(), x["table"].data_ptr(),
                                  x["lens"].data_ptr(), m.data_ptr(), l.data_ptr(), acc.data_ptr(), scale, b,
                                  MAX_BLOCKS, nsplit, NKV, torch.cuda.current_stream().cuda_stream)
    assert err == 0, f"CUDA error {err}"
    return m, l, acc


def compare(name: str, ref: tuple, got: tuple, lens: list[int]) -> dict:
    used = torch.zeros(len(lens), MAX_BLOCKS // PPS, dtype=torch.bool, device="cuda")
    for i, n in enumerate(lens):
        used[i, :-(-n // (PPS * BLOCK))] = True
    rec = {}
    for what, a, b in zip(("m", "l", "acc"), ref, got):
        mask = used[:, None, :].expand(a.shape[:3])
        if a.dim() == 4:
            mask = mask[..., None].expand(a.shape)
        a, b = a[mask], b[mask]
        diff = a.view(torch.int32) != b.view(torch.int32)
        rec[what] = dict(values=int(a.numel()), differ=int(diff.sum()))
        if diff.any():
            idx = diff.nonzero().flatten()[:4]
            rec[what]["first"] = [(float(a[i]), float(b[i])) for i in idx]
            rel = ((a - b).abs() / a.abs().clamp_min(1e-30))[diff]
            rec[what]["max_rel"] = float(rel.max())
    print(f"{name}: " + ", ".join(f"{k} {v['differ']} of {v['values']} differ" for k, v in rec.items()), flush=True)
    for k, v in rec.items():
        if v["differ"]:
            print(f"   {k}: first (triton, twin) {v['first']}, max rel {v['max_rel']:.3g}")
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    out = Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    lib = build(out)
    scale = HD ** -0.5
    res = {"q / k norm + RoPE + store": check_rope_store(lib)}
    cases = {"one row, 517": [517], "short rows": [1, 2, 15, 16, 17, 63, 64, 65],
             "long rows": [128, 500, 1000, 2047, 2048, 129, 777, 300]}
    for name, lens in cases.items():
        x = inputs(lens, seed=len(res))
        ref = triton_split(x, scale, 1, 1)
        got = twin_split(lib, x, scale)
        res[name] = compare(name, ref, got, lens)
        ref_out = triton_combine(ref, x["lens"])
        res[name + ", combine"] = compare_out(name + ", combine of the Triton splits", ref_out,
                                              twin_combine(lib, ref, x["lens"]))
        res[name + ", split + combine"] = compare_out(name + ", the twins' split + combine", ref_out,
                                                      twin_combine(lib, got, x["lens"]))
        res[name + " (B = 64's 4 splits a program, 2 stages)"] = compare(
            name + ", triton spp 4 vs spp 1", ref, triton_split(x, scale, 4, 2), lens)
    (out / "attn_twin.json").write_text(json.dumps(res, indent=1))
    bad = sum(v["differ"] for r in res.values() for v in r.values())
    print("all bitwise equal" if not bad else f"{bad} values differ")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
