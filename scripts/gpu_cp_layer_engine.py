#!/usr/bin/env python
"""Issue 16's small-batch kernel: whole code-predictor layers in one persistent launch with the
Triton graphs' bits, two ways:
1. `scripts/products_engine.cu` built with ROW_PHASES: per layer the four fp16 products (q|k|v,
   o_proj, gate|up + SwiGLU, down) as mma.sync chains over weight tiles that producer warps stream
   ahead, and the three row phases (the attention at one position, the residual + RMSNorm after
   o_proj and after down) as the Triton kernels' own PTX made device functions
   (`scripts/ptx_func.py`); a grid barrier between phases (any M <= 16);
2. the serving kernel, `csrc/small/cp_layers.cu` (M <= its qsk_max_rows(): one): four LL hops a
   layer, the row work redone by every block that needs it (the RMSNorm and the attention as twins of the Triton
   kernels), the launch's flags from an epoch word it advances; checked also as a CUDA graph
   replayed three times and across the epoch's wrap.

Checks every phase's outputs and the K/V cache bitwise against the same layers run as the Triton
launches the frame makes (`tk_gemm.linear`, `tk_glue.cp_attend`, `linear_parts`, `add_rms`,
`swiglu`), each variant from reset outputs, then times L layers inside the kernel (the first
block's start to the last block's end, globaltimer; median of 7 launches) against a CUDA graph of
those launches (20 replays, less an empty graph's), and prints the mean span of each phase kind
over the blocks and, for the serving kernel, thread 0's marks inside each hop and how late the last
block ends each hop. Writes $OUT/cp_layer_engine.json and, for the serving kernel, the raw marks and
hop starts of one launch ($OUT/ll_trace.npz). QSK_SRC: another source to build as the serving
kernel (a variant), QSK_NVCCFLAGS: more nvcc flags (-lineinfo for ncu); --only-ll: the serving
kernel alone.

  PYTHONPATH=. python3 scripts/gpu_cp_layer_engine.py --out $OUT [--ms 1 2 4 8] [--layers 5] [--only-ll]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import ptx_func  # noqa: E402
from gpu_products_engine import Product, timed  # noqa: E402

from tts_server.engines.batched import ops, pdl, small_kernel, tk_gemm, tk_glue  # noqa: E402

H, NH, NKV, HD, QKV, QD, I = 1024, 16, 8, 128, 4096, 2048, 3072
BS, POS, EPS = 16, 5, 1e-6  # the code predictor's K/V block (16 positions), the pass's position
SCALE = HD ** -0.5
ROW_KINDS = {"attend": 1, "add_rms4": 2, "add_rms6": 3}
GEN = ["-gencode", "arch=compute_90a,code=sm_90a", "-O3", "-Xcompiler", "-fPIC"]


def f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", float(v)))[0]


class RowKernel:
    """One Triton row kernel specialisation as a device function: its PTX converted, the order of
    its runtime arguments (pointers into `args`, scalars into `uargs`), threads and shared memory
    per program."""

    def __init__(self, kind: str, jitfn, args: list, kwargs: dict, grid: tuple):
        self.kind, self.name = ROW_KINDS[kind], f"tri_{kind}"
        k = jitfn.warmup(*args, grid=grid, **kwargs)
        self.ptx, _, self.threads = ptx_func.convert(k.asm["ptx"], self.name)
        self.runtime = ptx_func.runtime_args(k)
        self.nparams = self.ptx.split(")", 1)[0].count(".param") - len(ptx_func.EXTRA)
        self.smem = max(128, -(-int(k.metadata.shared) // 128) * 128)

    def call_source(self) -> str:
        """The C call of this kind inside row_call (a / u: the phase's pointer and scalar slots)."""
        pa = pu = 0
        actual = []
        for _, ty in self.runtime:
            if ty.startswith("*"):
                actual.append(f"a[{pa}]")
                pa += 1
            else:
                actual.append(f"u[{pu}]")
                pu += 1
        actual += ["nullptr"] * (self.nparams - len(self.runtime))  # Triton's own scratch pointers
        types = ["const void*" if x.startswith("a") or x == "nullptr" else "unsigned" for x in actual]
        decl = f'extern "C" __device__ void {self.name}({", ".join(types + ["unsigned"] * 6)});'
        call = f"case {self.kind}: {self.name}({', '.join(actual)}, px, py, 0u, tid, smem, bar); return;"
        return decl, call

    def fill(self, prod: Product, call_args: list, grid: tuple) -> None:
        """A row phase's slots from the launch's arguments (the same order as call_source)."""
        pa = pu = 0
        for i, ty in self.runtime:
            v = call_args[i]
            if ty.startswith("*"):
                prod.args[pa] = v.data_ptr()
                pa += 1
            else:
                prod.uargs[pu] = f32_bits(v) if ty == "fp32" else int(v) & 0xFFFFFFFF
                pu += 1
        assert pa <= 10 and pu <= 6, (pa, pu)
        prod.kind, prod.gx, prod.gy = self.kind, grid[0], grid[1] if len(grid) > 1 else 1
        prod.warps, prod.smem_per = self.threads // 32, self.smem


# cp_layers.cu's trace marks
LL_MARKS = ("polled", "first_round", "attended", "staged", "weights", "warp0_done", "done", "picked")
EPOCH_WRAP = 0xFFFFFF00  # cp_layers.cu's: a launch of this epoch or later zeroes the words, then epoch 0


def build(rows: list[RowKernel], source: str = "products_engine.cu") -> ctypes.CDLL:
    """scripts/<source> with ROW_PHASES, the row kernels' PTX and the generated row_call, linked."""
    work = Path(tempfile.mkdtemp())
    decls, calls = zip(*(r.call_source() for r in rows))
    shim = "\n".join(decls) + """
extern "C" __device__ void row_call(int kind, const void* const* a, const unsigned* u, unsigned px, unsigned py,
                                    unsigned tid, unsigned smem, unsigned bar) {
  switch (kind) {
    """ + "\n    ".join(calls) + """
    default: asm volatile("trap;");
  }
}
"""
    (work / "row_call.cu").write_text(shim)
    objs = []
    for r in rows:
        (work / f"{r.name}.ptx").write_text(r.ptx)
    for src in [ROOT / "scripts" / source, work / "row_call.cu"] + [work / f"{r.name}.ptx" for r in rows]:
        obj = work / (src.name + ".o")
        # a called function may use no more registers than the kernel has (288 threads a block: 168);
        # Triton's one-warp kernels assume 255 (what that spills does not change a bit)
        regs = ["-maxrregcount=168"] if src.suffix == ".ptx" else []
        subprocess.run(["nvcc", *GEN, *regs, "-rdc=true", "-DROW_PHASES", "-dc", "-o", str(obj), str(src)], check=True)
        objs.append(str(obj))
    lib = work / f"lib{Path(source).stem}.so"
    subprocess.run(["nvcc", *GEN, "-shared", "-o", str(lib), *objs], check=True)
    so = ctypes.CDLL(str(lib))
    so.products_engine_run.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                       ctypes.c_ulonglong, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                       ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p]
    so.products_engine_error_string.restype = ctypes.c_char_p
    assert so.products_engine_sizeof() == ctypes.sizeof(Product)
    return so


def build_small() -> ctypes.CDLL:
    """csrc/small/cp_layers.cu as the serving build makes it (csrc/Makefile's flags)."""
    lib = Path(tempfile.mkdtemp()) / "libqwen_small.so"
    src = os.environ.get("QSK_SRC", str(ROOT / "csrc" / "small" / "cp_layers.cu"))  # (a variant's source)
    subprocess.run(["nvcc", "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-gencode", "arch=compute_90a,code=sm_90a",
                    *os.environ.get("QSK_NVCCFLAGS", "").split(), "-shared", "-o", str(lib), src], check=True)
    return small_kernel.load(lib)


def make_layers(n: int, dev, gen) -> list[dict]:
    def w(rows, cols):
        return (torch.randn(rows, cols, device=dev, generator=gen) * 0.03).to(torch.bfloat16).to(torch.float16)

    def norm(d):
        return (1.0 + 0.1 * torch.randn(d, device=dev, generator=gen)).float()

    return [dict(qkv=w(QKV, H), o=w(H, QD), gate=w(I, H), up=w(I, H), down=w(H, I), post=norm(H), nxt=norm(H),
                 qn=norm(HD), kn=norm(HD)) for _ in range(n)]


class Buffers:
    """Every phase's output of every layer (no buffer reused, so each can be compared), for M rows."""

    def __init__(self, m: int, layers: int, dev, x0: torch.Tensor, h0: torch.Tensor, pools: list):
        f32, f16 = torch.float32, torch.float16
        e = lambda *shape, dt=f32: torch.full(shape, float("nan"), dtype=dt, device=dev)  # noqa: E731
        self.r = [x0.clone()] + [e(m, H) for _ in range(2 * layers)]  # residual after each add_rms
        self.h = [h0.clone()] + [e(m, H, dt=f16) for _ in range(2 * layers)]  # normed rows (fp16)
        self.qkv = [e(m, QKV) for _ in range(layers)]
        self.att = [e(m, QD, dt=f16) for _ in range(layers)]
        self.op = [e(4, m, H) for _ in range(layers)]
        self.inner = [e(m, I, dt=f16) for _ in range(layers)]
        self.dp = [e(6, m, H) for _ in range(layers)]
        self.kp = [p[0].clone() for p in pools]
        self.vp = [p[1].clone() for p in pools]

    def contiguous(self, m: int, layers: int) -> dict:
        """The per-layer outputs as views of one tensor each (cp_layers.cu writes them so): the
        tensors by cp_layers.cu's argument names."""
        f32, f16, dev = torch.float32, torch.float16, self.r[0].device
        e = lambda *shape, dt=f32: torch.full(shape, float("nan"), dtype=dt, device=dev)  # noqa: E731
        t = dict(dbg_r=e(2 * layers, m, H), dbg_h=e(2 * layers, m, H, dt=f16), qkv_g=e(layers, m, QKV),
                 att_g=e(layers, m, QD, dt=f16), dbg_o=e(layers, 4, m, H), dbg_inner=e(layers, m, I, dt=f16),
                 dbg_down=e(layers, 6, m, H))
        self.r[1:], self.h[1:] = list(t["dbg_r"]), list(t["dbg_h"])
        self.qkv, self.att, self.op = list(t["qkv_g"]), list(t["att_g"]), list(t["dbg_o"])
        self.inner, self.dp = list(t["dbg_inner"]), list(t["dbg_down"])
        return t

    def outputs(self) -> dict:
        return dict(r=self.r[1:], h=self.h[1:], qkv=self.qkv, att=self.att, o_parts=self.op, inner=self.inner,
                    down_parts=self.dp, k_cache=self.kp, v_cache=self.vp)


def attend_args(buf: Buffers, lw: dict, i: int, cos, sin) -> list:
    return [buf.qkv[i], lw["qn"], lw["kn"], cos, sin, buf.att[i], buf.kp[i], buf.vp[i], POS, EPS, SCALE]


ATTEND_KW = dict(NH=NH, NKV=NKV, BS=BS, HALF=HD // 2, GH=tk_glue.CP_ATTEND_HEADS, num_warps=tk_glue.CP_ATTEND_WARPS)


def attend_grid(m: int) -> tuple[int, int]:
    return tk_glue.cp_attend_grid(m, NH, NKV)


def add_rms_args(buf: Buffers, j: int, parts: torch.Tensor, w: torch.Tensor, m: int) -> list:
    return [buf.r[j], parts, w, buf.r[j + 1], buf.h[j + 1], EPS, m * H]


def add_rms_kw(parts: int) -> dict:
    return dict(D=H, DP2=1024, PARTS=parts)


def triton_layers(buf: Buffers, layers: list, cos, sin, m: int) -> None:
    """The layers as the frame's Triton launches (stack_forward's order and arguments)."""
    for i, lw in enumerate(layers):
        buf.qkv[i].copy_(tk_gemm.linear(buf.h[2 * i], lw["qkv"]))
        tk_glue._cp_attend_kernel[attend_grid(m)](*attend_args(buf, lw, i, cos, sin), **ATTEND_KW, **pdl.kw())
        buf.op[i].copy_(tk_gemm.linear_parts(buf.att[i], lw["o"]))
        tk_glue._add_rms_kernel[(m,)](*add_rms_args(buf, 2 * i, buf.op[i], lw["post"], m), **add_rms_kw(4),
                                      **pdl.kw())
        buf.inner[i].copy_(tk_gemm.swiglu(buf.h[2 * i + 1], lw["gate"], lw["up"], torch.float16, ops.MLP_SHIFT))
        buf.dp[i].copy_(tk_gemm.linear_parts(buf.inner[i], lw["down"], ops.MLP_SHIFT))
        tk_glue._add_rms_kernel[(m,)](*add_rms_args(buf, 2 * i + 1, buf.dp[i], lw["nxt"], m), **add_rms_kw(6),
                                      **pdl.kw())


def triton_graph_layers(buf: Buffers, layers: list, cos, sin, m: int) -> None:
    """The same launches writing straight into their outputs (no copies): what a graph replays."""
    for i, lw in enumerate(layers):
        q = tk_gemm.linear(buf.h[2 * i], lw["qkv"])
        a = tk_glue.cp_attend(q, lw["qn"], lw["kn"], cos, sin, buf.kp[i], buf.vp[i], POS, NH, NKV, EPS, SCALE,
                              torch.float16)
        x, h = tk_glue.add_rms(buf.r[2 * i], tk_gemm.linear_parts(a.view(m, QD), lw["o"]), lw["post"], EPS,
                               torch.float16)
        inner = tk_gemm.swiglu(h, lw["gate"], lw["up"], torch.float16, ops.MLP_SHIFT)
        x, h = tk_glue.add_rms(x, tk_gemm.linear_parts(inner, lw["down"], ops.MLP_SHIFT), lw["nxt"], EPS,
                               torch.float16)


def engine_phases(buf: Buffers, layers: list, tiled: dict, rows: dict, cos, sin, m: int):
    phases, kinds = [], []

    def product(kind, w, w2, x, out, n, k, piece, scale):
        phases.append(Product(tiled[w.data_ptr()].data_ptr(), tiled[w2.data_ptr()].data_ptr() if w2 is not None
                              else 0, x.data_ptr(), out.data_ptr(), n, k, piece, scale))
        kinds.append(kind)

    def row(kind, args, grid):
        p = Product()
        rows[kind].fill(p, args, grid)
        phases.append(p)
        kinds.append(kind)

    for i, lw in enumerate(layers):
        product("qkv", lw["qkv"], None, buf.h[2 * i], buf.qkv[i], QKV, H, 1024, 1.0)
        row("attend", attend_args(buf, lw, i, cos, sin), attend_grid(m))
        product("o", lw["o"], None, buf.att[i], buf.op[i], H, QD, 512, 1.0)
        row("add_rms4", add_rms_args(buf, 2 * i, buf.op[i], lw["post"], m), (m,))
        product("gate_up", lw["gate"], lw["up"], buf.h[2 * i + 1], buf.inner[i], I, H, 1024, 2.0 ** -ops.MLP_SHIFT)
        product("down", lw["down"], None, buf.inner[i], buf.dp[i], H, I, 512, 2.0 ** ops.MLP_SHIFT)
        row("add_rms6", add_rms_args(buf, 2 * i + 1, buf.dp[i], lw["nxt"], m), (m,))
    return (Product * len(phases))(*phases), kinds


def compare(mine: Buffers, ref: Buffers) -> tuple[dict, bool]:
    """Bitwise equal values of every output, [equal, total] by name; all equal?"""
    bits = {}
    for key, ours in mine.outputs().items():
        eq = tot = 0
        for o, r in zip(ours, ref.outputs()[key]):
            view = {2: torch.int16, 4: torch.int32}[o.element_size()]
            eq += int((o.view(view) == r.view(view)).sum())
            tot += o.numel()
        bits[key] = [eq, tot]
    return bits, all(eq == tot for eq, tot in bits.values())


def reset(buf: Buffers, pools: list) -> None:
    """Every output written afresh by the next launch: outputs 0xFF, the K/V caches as they started."""
    for key, outs in buf.outputs().items():
        for i, t in enumerate(outs):
            if key in ("k_cache", "v_cache"):
                t.copy_(pools[i][0 if key == "k_cache" else 1])
            else:
                t.view(torch.uint8).fill_(0xFF)


def checked(launch, err: torch.Tensor, mine: Buffers, ref: Buffers, pools: list, label: str) -> tuple[dict, bool]:
    """One launch from reset outputs, compared bitwise with the Triton launches' (printed); err:
    the kernel's error word."""
    reset(mine, pools)
    launch()
    torch.cuda.synchronize()
    assert int(err) == 0, f"{label}: the engine gave up a wait (error {int(err)})"
    bits, ok = compare(mine, ref)
    print(f"{label}: bits {'EQUAL' if ok else 'DIFFER'}: " + ", ".join(f"{k} {e}/{t}" for k, (e, t) in bits.items()),
          flush=True)
    return bits, ok


def spans(launch, t0s: torch.Tensor, kinds: list, layers: int, runs: int = 7, skew: bool = False) -> tuple[float, dict]:
    """µs per layer inside the kernel (the first block's start to the last block's end, median of
    runs) and each phase kind's span (its start to the next phase's start, mean over blocks, median
    over phases and runs). skew: also print, per kind, how much later than the mean block the last
    block ends it (µs, mean over phases and runs) and the mean end (µs after the mean) of blocks
    0-59, 60-119 and 120 on."""
    per_layer, per_kind, late = [], {}, {}
    for _ in range(runs):
        launch()  # (the K/V cache is rewritten at the same position with the same values)
        torch.cuda.synchronize()
        t = t0s.cpu().numpy()
        per_layer.append((t[:, -1].max() - t[:, 0].min()) / 1e3 / layers)
        d = (t[:, 1:] - t[:, :-1]).astype(np.float64) / 1e3  # [G, phases]
        for j, kind in enumerate(kinds):
            per_kind.setdefault(kind, []).append(float(d[:, j].mean()))
            end = t[:, j + 1].astype(np.float64) / 1e3
            end -= end.mean()
            late.setdefault(kind, []).append([end.max(), end[:60].mean(), end[60:120].mean(), end[120:].mean()])
    if skew:
        for kind, v in late.items():
            m = np.mean(v, axis=0)
            print(f"  end skew {kind:8s} last {m[0]:.2f} µs after the mean; blocks 0-59 {m[1]:+.2f}, 60-119 "
                  f"{m[2]:+.2f}, 120- {m[3]:+.2f}", flush=True)
    return statistics.median(per_layer), {k: round(statistics.median(v), 3) for k, v in per_kind.items()}


def ll_marks(launch, args: small_kernel.Args, trace: torch.Tensor, label: str, t0s: torch.Tensor | None = None,
             out: str | None = None) -> dict:
    """One launch with thread 0's marks in every product (cp_layers.cu's trace): µs since the
    product's start by kind, means over blocks and the layers after the first (None: not marked)."""
    trace.zero_()
    args.trace = trace.data_ptr()
    launch()
    torch.cuda.synchronize()
    args.trace = None
    if out is not None:  # the raw marks and hop starts of this launch (for per-block analyses)
        np.savez(Path(out, "ll_trace.npz"), trace=trace.cpu().numpy(), t0s=t0s.cpu().numpy())
    tr = trace.cpu().numpy().astype(np.float64)[:, 4:] / 1e3
    marks = {}
    for j, kind in enumerate(("qkv", "o", "gate_up", "down")):
        sub = tr[:, j::4]
        marks[kind] = {name: round(float(sub[..., k][sub[..., k] > 0].mean()), 3) if (sub[..., k] > 0).any()
                       else None for k, name in enumerate(LL_MARKS)}
        print(f"  LL marks ({label}) {kind:8s} "
              + " ".join(f"{k} {v}" for k, v in marks[kind].items() if v is not None), flush=True)
    return marks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--ms", type=int, nargs="*", default=[1, 2, 4, 8], help="row counts")
    ap.add_argument("--only-ll", action="store_true",
                    help="the serving kernel only (not the row phases + grid barriers build; e.g. under ncu)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    layers = make_layers(a.layers, dev, gen)
    tiled = {w.data_ptr(): small_kernel.tile(w) for lw in layers for key, w in lw.items() if w.dtype == torch.float16}
    ang = torch.arange(HD // 2, device=dev, dtype=torch.float32) * 0.05 * POS
    cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
    sync = torch.zeros(4, dtype=torch.int32, device=dev)
    stream = lambda: ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)  # noqa: E731

    rows: dict = {}
    if not a.only_ll:  # (their PTX: not in a carried Triton cache, which keeps the binaries only)
        # the row kernels' specialisations (M = 1's arguments; every M specialises alike)
        m0 = 1
        pools0 = [(torch.randn(m0, NKV, BS, HD, device=dev, generator=gen),) * 2 for _ in range(a.layers)]
        b0 = Buffers(m0, a.layers, dev, torch.randn(m0, H, device=dev), torch.zeros(m0, H, dtype=torch.float16,
                                                                                    device=dev), pools0)
        rows = {"attend": RowKernel("attend", tk_glue._cp_attend_kernel, attend_args(b0, layers[0], 0, cos, sin),
                                    dict(ATTEND_KW, **pdl.kw()), attend_grid(m0)),
                "add_rms4": RowKernel("add_rms4", tk_glue._add_rms_kernel, add_rms_args(b0, 0, b0.op[0],
                                                                                      layers[0]["post"], m0),
                                      dict(add_rms_kw(4), **pdl.kw()), (m0,)),
                "add_rms6": RowKernel("add_rms6", tk_glue._add_rms_kernel, add_rms_args(b0, 1, b0.dp[0],
                                                                                      layers[0]["nxt"], m0),
                                      dict(add_rms_kw(6), **pdl.kw()), (m0,))}
    so = build(list(rows.values())) if rows else None
    small = build_small()
    results = []
    for m in a.ms:
        x0 = torch.randn(m, H, device=dev, generator=gen)
        h0 = tk_gemm.rms_norm(x0, layers[0]["nxt"], EPS, torch.float16)
        pools = [(torch.randn(m, NKV, BS, HD, device=dev, generator=gen),
                  torch.randn(m, NKV, BS, HD, device=dev, generator=gen)) for _ in range(a.layers)]
        ref = Buffers(m, a.layers, dev, x0, h0, pools)
        triton_layers(ref, layers, cos, sin, m)
        rec = {"m": m, "layers": a.layers}

        # (1) products_engine.cu with row phases, grid barriers between phases
        mine = Buffers(m, a.layers, dev, x0, h0, pools)
        if so is not None:
            table, kinds = engine_phases(mine, layers, tiled, rows, cos, sin, m)
            t0s = torch.zeros(sms, len(kinds) + 1, dtype=torch.int64, device=dev)

            def engine():
                sync.zero_()
                ret = so.products_engine_run(ctypes.addressof(table), len(kinds), m, ctypes.c_void_p(sync.data_ptr()),
                                             sms, 2_000_000_000, 0, 0, 1, None, 0, None, ctypes.c_void_p(t0s.data_ptr()),
                                             None, None, 0, stream())
                assert ret > 0, (f"launch error {ret}: " + (so.products_engine_error_string(-ret).decode() if ret < -2
                                                            else "arguments"))

            bits, ok = checked(engine, sync[2], mine, ref, pools, f"M={m} row phases + grid barriers")
            t_engine, phase_us = spans(engine, t0s, kinds, a.layers)
            rec.update(barriers={"bitwise": bits, "bits_equal": ok, "us_per_layer": round(t_engine, 3),
                                 "phase_span_us_mean": phase_us})

        # (2) the serving kernel, csrc/small/cp_layers.cu: four LL hops a layer (M <= qsk_max_rows())
        if m <= small.qsk_max_rows():
            ll = Buffers(m, a.layers, dev, x0, h0, pools)
            outs = ll.contiguous(m, a.layers)
            out_h = torch.full((m, H), float("nan"), dtype=torch.float16, device=dev)
            words = torch.zeros(int(small.qsk_words_len()), dtype=torch.int64, device=dev)
            sync_ll = torch.zeros(4, dtype=torch.int32, device=dev)  # error, epoch, blocks done
            blocks = int(small.qsk_grid(sms))
            kinds_ll = ["qkv", "o", "gate_up", "down"] * a.layers
            t0s_ll = torch.zeros(blocks, len(kinds_ll) + 1, dtype=torch.int64, device=dev)
            args = small_kernel.Args(nl=a.layers, M=m, x0=ll.r[0].data_ptr(), h0=ll.h[0].data_ptr(),
                                     cos=cos.data_ptr(), sin=sin.data_ptr(), pos=POS, eps=EPS, scale=SCALE,
                                     words=words.data_ptr(), sync=sync_ll.data_ptr(), out_h=out_h.data_ptr(),
                                     timeout_ns=2_000_000_000, t0s=t0s_ll.data_ptr(),
                                     **{k: v.data_ptr() for k, v in outs.items()})
            for i, lw in enumerate(layers):
                L = args.L[i]
                for j, key in enumerate(("qkv", "o", "gate", "up", "down")):
                    L.w[j] = tiled[lw[key].data_ptr()].data_ptr()
                L.post, L.nxt, L.qn, L.kn = (lw[k].data_ptr() for k in ("post", "nxt", "qn", "kn"))
                L.kpool, L.vpool = ll.kp[i].data_ptr(), ll.vp[i].data_ptr()
            rc = small.qsk_setup(ctypes.byref(args), blocks)
            print(f"  serving kernel: grid {blocks} blocks ({sms} SMs), setup {rc}", flush=True)
            assert rc == 0, f"qsk_setup returned {rc}"

            def engine_ll():
                ret = small.qsk_run(ctypes.byref(args), blocks, stream(), 0)
                assert ret == 0, f"launch error {ret}: " + (small.qsk_error_string(-ret).decode() if ret < -2
                                                             else "arguments")

            def out_equal() -> bool:
                return bool((out_h.view(torch.int16) == ref.h[-1].view(torch.int16)).all())

            bits_ll, ok_ll = checked(engine_ll, sync_ll[0], ll, ref, pools, f"M={m} LL, four hops a layer")
            ok_ll = ok_ll and out_equal()
            # the first norm made in the kernel (as serving launches it: no h0)
            args.h0, args.nrm0 = None, layers[0]["nxt"].data_ptr()
            out_h.fill_(float("nan"))
            _, ok_n0 = checked(engine_ll, sync_ll[0], ll, ref, pools, f"M={m} LL, the first norm in the kernel")
            ok_ll = ok_ll and ok_n0 and out_equal()
            # as a CUDA graph replayed (the flags from the epoch word: new at every replay)
            graph_ll, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s), torch.cuda.graph(graph_ll, stream=s):
                engine_ll()
            torch.cuda.current_stream().wait_stream(s)
            replays = []
            for r in range(3):
                out_h.fill_(float("nan"))
                _, ok_r = checked(graph_ll.replay, sync_ll[0], ll, ref, pools, f"M={m} LL, graph replay {r}")
                replays.append(ok_r and out_equal())
            # across the epoch's wrap: the launch at EPOCH_WRAP zeroes the words and starts again at 0
            sync_ll[1] = EPOCH_WRAP - 64 - (1 << 32)
            wrap = []
            for r in range(3):
                out_h.fill_(float("nan"))
                epoch = int(sync_ll[1]) & 0xFFFFFFFF
                _, ok_r = checked(engine_ll, sync_ll[0], ll, ref, pools, f"M={m} LL, epoch {epoch:#x}")
                wrap.append(ok_r and out_equal())
            assert int(sync_ll[1]) == 64, f"epoch after the wrap: {int(sync_ll[1])}"
            t_ll, phase_ll = spans(engine_ll, t0s_ll, kinds_ll, a.layers, skew=True)
            trace = torch.zeros(blocks, len(kinds_ll), 8, dtype=torch.int32, device=dev)
            marks = ll_marks(engine_ll, args, trace, "serving kernel", t0s_ll, a.out)
            t_graph_ll = timed(graph_ll.replay)
            print(f"  M={m} serving kernel: bits {'EQUAL' if ok_ll else 'DIFFER'} (out_h too), graph replays "
                  f"{replays}, across the epoch wrap {wrap}; {t_ll:.2f} µs a layer inside the kernel, "
                  f"{t_graph_ll / a.layers:.2f} a layer as a graph of one launch", flush=True)
            rec.update(ll={"bitwise": bits_ll, "bits_equal": ok_ll, "graph_replays_equal": replays,
                           "epoch_wrap_equal": wrap, "us_per_layer": round(t_ll, 3),
                           "graph_us_per_layer": round(t_graph_ll / a.layers, 3),
                           "phase_span_us_mean": phase_ll, "marks_us": marks})

        graph, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            triton_graph_layers(mine, layers, cos, sin, m)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=s):
                triton_graph_layers(mine, layers, cos, sin, m)
            empty = torch.cuda.CUDAGraph()
            with torch.cuda.graph(empty, stream=s):
                sync.zero_()
        torch.cuda.current_stream().wait_stream(s)
        rec["triton_graph_us_per_layer"] = round((timed(graph.replay) - timed(empty.replay)) / a.layers, 3)
        results.append(rec)
        for label, key in (("row phases + grid barriers", "barriers"), ("LL, four hops a layer", "ll")):
            if key in rec:
                print(f"  µs per layer: {label} {rec[key]['us_per_layer']:.2f}, Triton graph "
                      f"{rec['triton_graph_us_per_layer']:.2f}; phase spans (µs, mean over blocks): "
                      + ", ".join(f"{k} {v:.2f}" for k, v in rec[key]["phase_span_us_mean"].items()), flush=True)
    env = {"device": torch.cuda.get_device_name(), "sms": sms, "torch": torch.__version__,
           "triton": __import__("triton").__version__,
           "row_kernels": {k: {"threads": r.threads, "smem": r.smem, "runtime_args": len(r.runtime)}
                           for k, r in rows.items()}}
    Path(a.out, "cp_layer_engine.json").write_text(json.dumps({"env": env, "results": results}, indent=1))
    print(json.dumps(env))


if __name__ == "__main__":
    main()
