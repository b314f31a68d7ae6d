#!/usr/bin/env python
"""Can a hand-written CUDA kernel give the batched engine's Triton GEMM bits? (Issue 16: a
persistent small-batch frame kernel could serve B <= 16 beside the Triton graphs only if a
stream's values do not change when it moves between them; the products are the first thing that
must match.)

The serving products (fp16 matrices, x rounded to fp16, K in pieces: `tk_gemm.linear_parts`) at
the 0.6B shapes and several row counts (so several Triton tiles: mma.sync and, where Triton picks
it, wgmma) against `scripts/dot_bits.cu`: one fp32 `mma.sync.m16n8k16` chain per piece over its
16-column steps in order. Prints, per (shape, M), the Triton tile, whether its PTX has wgmma, and
how many of the piece values are bitwise equal. Then the residual add + RMSNorm of the frame
(`tk_glue.add_rms`) against a CUDA twin written from its Triton 3.6 PTX (the same element
ownership, reduction tree and approximate division / square root), and so the input RMSNorm
(`tk_gemm.rms_norm`) and the SwiGLU product (`tk_gemm.swiglu`, its epilogue's ex2.approx and
div.full). Session 37 checked add_rms with an fp16 out on an H200; the fp32-out norms (another
element ownership) and the SwiGLU twin were written then and had not run on a GPU. Then the
clock cycles of the products' accumulator chain (dependent mma.sync steps), the floor under a
piece of K columns in a kernel that keeps these bits. Then the frame's Triton kernels run as
device functions from their own PTX (`scripts/ptx_func.py`): add_rms, rms_norm, cp_attend and the
code predictor's draw against their launches, and the talker step's ops (paged attention, q/k
norm + RoPE + KV store, logit processing, draw) replayed launch by launch on the same buffers.
A section that fails is recorded and the rest run. Writes $OUT/dot_bits.json (after each section).

  PYTHONPATH=. python3 scripts/gpu_dot_bits.py --out $OUT
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tts_server.engines.batched import tk_gemm  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
import ptx_func  # noqa: E402

SHAPES = (("q|k|v", 4096, 1024), ("o_proj", 1024, 2048), ("down", 1024, 3072), ("codec head", 3072, 1024),
          ("cp head", 2048, 1024))
ROWS = (1, 4, 16, 17, 33, 64, 65, 128, 256)


def build() -> ctypes.CDLL:
    lib = Path(tempfile.mkdtemp()) / "libdot_bits.so"
    subprocess.run(["nvcc", "-arch=sm_90", "-O2", "-shared", "-Xcompiler", "-fPIC", "-o", str(lib),
                    str(ROOT / "scripts" / "dot_bits.cu")], check=True)
    so = ctypes.CDLL(str(lib))
    so.dot_bits_parts_fp16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4 + [ctypes.c_void_p]
    so.dot_bits_add_rms.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int, ctypes.c_float] + [ctypes.c_int] * 2
                                    + [ctypes.c_void_p])
    so.dot_bits_mma_chain.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    so.dot_bits_chain_smem.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    so.dot_bits_timer_reads.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    so.dot_bits_rms_norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_float, ctypes.c_int, ctypes.c_int,
                                                             ctypes.c_void_p]
    so.dot_bits_swiglu.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_float, ctypes.c_void_p]
    return so


def _stream():
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of a and b (same shape and dtype) are bitwise equal."""
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return int((a.view(view) == b.view(view)).sum())


def rms_norm_section(so, dev, gen) -> list[dict]:
    """tk_gemm.rms_norm (a pass's input norm; fp16 out before fp16 products, fp32 out) against its
    twin written from the Triton 3.6 PTX (sqrt.rn where add_rms has sqrt.approx.ftz)."""
    out = []
    d, eps = 1024, 1e-6
    w = (1.0 + 0.1 * torch.randn(d, device=dev, generator=gen)).float()
    for dtype in (torch.float16, torch.float32):
        for m in (1, 3, 17, 64, 256):
            x = 3.0 * torch.randn(m, d, device=dev, generator=gen)
            tri = tk_gemm.rms_norm(x, w, eps, dtype)
            cu = torch.empty_like(tri)
            assert so.dot_bits_rms_norm(x.data_ptr(), w.data_ptr(), cu.data_ptr(), int(dtype == torch.float16), eps,
                                        m, d, _stream()) == 0
            torch.cuda.synchronize()
            rec = {"op": "rms_norm", "dtype": str(dtype), "m": m, "values": m * d, "out_equal": _same_bits(tri, cu),
                   "out_max_abs_diff": float((tri.float() - cu.float()).abs().max())}
            out.append(rec)
            print(f"rms_norm {dtype} m={m:3d} out equal {rec['out_equal']}/{m * d} maxdiff "
                  f"{rec['out_max_abs_diff']:.3g}", flush=True)
    return out


def swiglu_section(so, dev, gen) -> list[dict]:
    """tk_gemm.swiglu with fp16 matrices into fp16 times 2^-6 (the code predictor's gate|up before
    its fp16 down projection, ops.MLP_SHIFT) against the twin: two mma.sync chains and the
    epilogue of the Triton 3.6 PTX (ex2.approx, div.full)."""
    from tts_server.engines.batched import ops

    out = []
    n, k, shift = 3072, 1024, ops.MLP_SHIFT
    wg = (torch.randn(n, k, device=dev, generator=gen) * 0.03).to(torch.bfloat16).to(torch.float16)
    wu = (torch.randn(n, k, device=dev, generator=gen) * 0.03).to(torch.bfloat16).to(torch.float16)
    for m in (1, 4, 16, 17, 64, 256):
        x = torch.randn(m, k, device=dev, generator=gen).to(torch.float16)
        tri = tk_gemm.swiglu(x, wg, wu, torch.float16, shift)
        cu = torch.empty_like(tri)
        assert so.dot_bits_swiglu(x.data_ptr(), wg.data_ptr(), wu.data_ptr(), cu.data_ptr(), m, n, k,
                                  2.0 ** -shift, _stream()) == 0
        torch.cuda.synchronize()
        rec = {"op": "swiglu", "m": m, "values": m * n, "out_equal": _same_bits(tri, cu),
               "out_max_abs_diff": float((tri.float() - cu.float()).abs().max())}
        out.append(rec)
        print(f"swiglu m={m:3d} out equal {rec['out_equal']}/{m * n} maxdiff {rec['out_max_abs_diff']:.3g}",
              flush=True)
    return out


def _fewest_cycles(launch, words: int, dev) -> list[int]:
    """Each of a timing kernel's `words` output words (clock cycles), the least over 5 launches."""
    buf = torch.zeros(words, dtype=torch.int64, device=dev)
    runs = []
    for _ in range(5):
        assert launch(buf.data_ptr(), _stream()) == 0
        torch.cuda.synchronize()
        runs.append(buf.tolist())
    return [min(r[i] for r in runs) for i in range(words)]


def chain_section(so, dev) -> list[dict]:
    """Clock cycles per step of a product's accumulator chain (dependent mma.sync, 1-4 chains
    interleaved in one warp): the floor under a piece of K columns, K / 16 steps long."""
    out = []
    for chains in (1, 2, 4, 8):
        for steps in (64, 256):
            best = _fewest_cycles(lambda p, st: so.dot_bits_mma_chain(p, steps, chains, st), 2, dev)[0]
            out.append({"op": "mma_chain", "chains": chains, "steps": steps, "cycles": best,
                        "cycles_per_step": best / steps})
            print(f"mma chain: {chains} chain(s) x {steps} steps: {best} cycles, {best / steps:.1f} per step",
                  flush=True)
    return out


CHAIN_VARS = {0: "A ldmatrix + B 2 lds (the prototype)", 1: "A ldmatrix only", 2: "B lds only",
              3: "operands in registers", 4: "A ldmatrix + B ldmatrix.x4 per 2 steps"}


def chain_smem_section(so, dev) -> list[dict]:
    """Cycles per step of a 64-step chain whose operands come from shared memory (dot_bits.cu
    chain_smem), by operand path and by how many steps ahead the loads run."""
    out = []
    for var, what in CHAIN_VARS.items():
        for la in (1, 2, 4, 8):
            best = _fewest_cycles(lambda p, st: so.dot_bits_chain_smem(p, la, var, st), 2, dev)[0]
            out.append({"op": "chain_smem", "var": var, "what": what, "lookahead": la, "cycles": best,
                        "cycles_per_step": best / 64})
            print(f"chain from shared memory: {what}, loads {la} step(s) ahead: {best / 64:.1f} cycles a step",
                  flush=True)
    g, c, _ = _fewest_cycles(so.dot_bits_timer_reads, 3, dev)
    out.append({"op": "timer_reads", "globaltimer_cycles": g / 64, "clock64_cycles": c / 64})
    print(f"a %globaltimer read: {g / 64:.1f} cycles; a clock64 read: {c / 64:.1f}", flush=True)
    return out


def add_rms_section(so, dev, gen) -> list[dict]:
    """tk_glue.add_rms (the residual add over a product's parts + RMSNorm; fp16 out: the frame's
    norms before fp16 products; fp32 out: a stack's final norm) against its CUDA twin written from
    the Triton 3.6 PTX."""
    from tts_server.engines.batched import tk_glue

    out = []
    d, eps = 1024, 1e-6
    w = (1.0 + 0.1 * torch.randn(d, device=dev, generator=gen)).float()
    for dtype in (torch.float16, torch.float32):
        for parts in (1, 4, 6):
            for m in (1, 3, 17, 64, 256):
                x = torch.randn(m, d, device=dev, generator=gen)
                y = 0.3 * torch.randn(parts, m, d, device=dev, generator=gen)
                s_tri, h_tri = tk_glue.add_rms(x, y, w, eps, dtype)
                s_cu = torch.empty_like(x)
                h_cu = torch.empty(m, d, dtype=dtype, device=dev)
                err = so.dot_bits_add_rms(x.data_ptr(), y.data_ptr(), w.data_ptr(), s_cu.data_ptr(), h_cu.data_ptr(),
                                          int(dtype == torch.float16), eps, m, parts, _stream())
                torch.cuda.synchronize()
                assert err == 0, f"CUDA error {err}"
                rec = {"op": "add_rms", "dtype": str(dtype), "parts": parts, "m": m,
                       "sum_equal": _same_bits(s_tri, s_cu), "out_equal": _same_bits(h_tri, h_cu), "values": m * d,
                       "out_max_abs_diff": float((h_tri.float() - h_cu.float()).abs().max())}
                out.append(rec)
                print(f"add_rms {dtype} parts={parts} m={m:3d} sum equal {rec['sum_equal']}/{m * d} out equal "
                      f"{rec['out_equal']}/{m * d} maxdiff {rec['out_max_abs_diff']:.3g}", flush=True)
    return out


def _as_func(jitfn, args: list, kwargs: dict, grid: tuple, name: str, workdir: Path):
    """The Triton kernel specialisation that `jitfn[grid](*args, **kwargs)` runs, turned into a
    device function by scripts/ptx_func.py and called by a generated __global__ wrapper with the
    same arguments: -> run(args) that launches the wrapper over `grid` (threads and shared memory
    as the Triton kernel's)."""
    import struct

    k = jitfn.warmup(*args, grid=grid, **kwargs)
    text, _, threads = ptx_func.convert(k.asm["ptx"], name)
    runtime = ptx_func.runtime_args(k)  # the launch's runtime arguments: index, type
    kinds = [ty for _, ty in runtime]
    nparams = len(re.findall(rf"\.param \.b(?:32|64) {name}_p\d+", text))
    extra = nparams - len(kinds)  # Triton's own trailing pointers (scratch buffers): passed null
    ctypes_of = ["p" if ty.startswith("*") else ty for ty in kinds] + ["p"] * extra
    cargs = ", ".join(f"{'const void*' if t == 'p' else 'unsigned'} a{i}" for i, t in enumerate(ctypes_of))
    names = ", ".join(f"a{i}" for i in range(len(ctypes_of)))
    src = f"""
extern "C" __device__ void {name}({", ".join("const void*" if t == "p" else "unsigned" for t in ctypes_of)},
    unsigned, unsigned, unsigned, unsigned, unsigned, unsigned);
__global__ void {name}_k({cargs}) {{
  extern __shared__ __align__(16) unsigned char smem[];
  {name}({names}, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, (unsigned)__cvta_generic_to_shared(smem), 1u);
}}
extern "C" int {name}_launch({cargs}, unsigned gx, unsigned gy, unsigned gz, unsigned shmem, void* stream) {{
  if (shmem > 48 * 1024) cudaFuncSetAttribute({name}_k, cudaFuncAttributeMaxDynamicSharedMemorySize, shmem);
  {name}_k<<<dim3(gx, gy, gz), {threads}, shmem, (cudaStream_t)stream>>>({names});
  return (int)cudaGetLastError();
}}
"""
    (workdir / f"{name}.ptx").write_text(text)
    (workdir / f"{name}_k.cu").write_text(src)
    gen = ["-gencode", "arch=compute_90a,code=sm_90a", "-Xcompiler", "-fPIC"]
    for f in (f"{name}.ptx", f"{name}_k.cu"):
        subprocess.run(["nvcc", *gen, "-dc", "-o", str(workdir / (f + ".o")), str(workdir / f)], check=True)
    so_path = workdir / f"lib{name}.so"
    subprocess.run(["nvcc", *gen, "-shared", "-o", str(so_path), str(workdir / f"{name}.ptx.o"),
                    str(workdir / f"{name}_k.cu.o")], check=True)
    so = ctypes.CDLL(str(so_path))
    fn = getattr(so, f"{name}_launch")
    shmem = int(k.metadata.shared)

    def run(call_args: list) -> None:
        c = []
        for v, t in ((call_args[i], ty) for i, ty in runtime):
            if t.startswith("*"):
                c.append(ctypes.c_void_p(v.data_ptr()))
            elif t == "fp32":
                c.append(ctypes.c_uint(struct.unpack("<I", struct.pack("<f", float(v)))[0]))
            else:
                c.append(ctypes.c_uint(int(v) & 0xFFFFFFFF))
        c += [ctypes.c_void_p(0)] * extra
        g = tuple(grid) + (1,) * (3 - len(grid))
        err = fn(*c, *(ctypes.c_uint(x) for x in g), ctypes.c_uint(shmem), _stream())
        assert err == 0, f"CUDA error {err}"

    return run, threads, shmem


def triton_func_section(dev, gen) -> list[dict]:
    """The frame's Triton row kernels run as device functions of a CUDA kernel (their own PTX,
    turned into `.func`s by scripts/ptx_func.py): the same bits as the Triton launches? add_rms
    and rms_norm (fp16 and fp32 out), the code predictor's attention (cp_attend at position 5)
    and its draw (tk_sample's kernel with the next pass's embedding)."""
    from tts_server.engines.batched import pdl, tk_glue

    workdir = Path(tempfile.mkdtemp())
    out = []

    def check(label, jitfn, make_args, kwargs, grid, outputs):
        a = make_args()  # the Triton launch's arguments (fresh outputs)
        b = make_args()
        jitfn[grid](*a, **kwargs)
        run, threads, shmem = _as_func(jitfn, a, kwargs, grid, "tri_" + label.replace(" ", "_").replace("-", "_"),
                                       workdir)
        run(b)
        torch.cuda.synchronize()
        eq = sum(_same_bits(a[i], b[i]) for i in outputs)
        n = sum(a[i].numel() for i in outputs)
        rec = {"op": "triton_func", "kernel": label, "values": n, "equal": eq, "threads": threads, "smem": shmem}
        out.append(rec)
        print(f"triton as a device function: {label}: equal {eq}/{n} ({threads} threads, {shmem} B smem)", flush=True)

    d, eps, m = 1024, 1e-6, 17
    w = (1.0 + 0.1 * torch.randn(d, device=dev, generator=gen)).float()
    x0 = torch.randn(m, d, device=dev, generator=gen)
    y0 = 0.3 * torch.randn(4, m, d, device=dev, generator=gen)
    for dtype in (torch.float16, torch.float32):
        tag = "f16" if dtype == torch.float16 else "f32"
        check(f"add_rms p4 {tag}", tk_glue._add_rms_kernel,
              lambda dtype=dtype: [x0, y0, w, torch.empty_like(x0), torch.empty(m, d, dtype=dtype, device=dev), eps,
                                   m * d],
              dict(D=d, DP2=1024, PARTS=4, **pdl.kw()), (m,), (3, 4))
        check(f"rms_norm {tag}", tk_gemm._rms_norm_kernel,
              lambda dtype=dtype: [x0, w, torch.empty(m, d, dtype=dtype, device=dev), d, eps, d, d],
              dict(BLOCK_D=1024, num_warps=4, **pdl.kw()), (m,), (2,))
    # cp_attend at position 5: 16 q heads, 8 kv heads of 128, blocks of 16 positions (fp32 pools)
    nh, nkv, hd, bs, pos = 16, 8, 128, 16, 5
    qkv = torch.randn(m, (nh + 2 * nkv) * hd, device=dev, generator=gen)
    qn = (1.0 + 0.1 * torch.randn(hd, device=dev, generator=gen)).float()
    kn = (1.0 + 0.1 * torch.randn(hd, device=dev, generator=gen)).float()
    ang = torch.arange(hd // 2, device=dev, dtype=torch.float32) * 0.05 * pos
    cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
    pool_k = torch.randn(m, nkv, bs, hd, device=dev, generator=gen)
    pool_v = torch.randn(m, nkv, bs, hd, device=dev, generator=gen)
    check("cp_attend f16", tk_glue._cp_attend_kernel,
          lambda: [qkv, qn, kn, cos, sin, torch.empty(m, nh, hd, dtype=torch.float16, device=dev), pool_k.clone(),
                   pool_v.clone(), pos, eps, 1.0 / hd ** 0.5],
          dict(NH=nh, NKV=nkv, BS=bs, HALF=hd // 2, num_warps=tk_glue.CP_ATTEND_WARPS, **pdl.kw()), (m, nkv),
          (5, 6, 7))
    # a code-predictor draw as the frame makes it (tk_sample.sample_tokens): the head's two partial
    # products, top-k 50, top-p 0.8, the counter-based noise, the next pass's embedding row, the
    # code into the step's output
    from tts_server.engines.batched import tk_sample

    v, h = 2048, 1024
    parts = 3.0 * torch.randn(2, m, v, device=dev, generator=gen)
    table = torch.randn(v, h, device=dev, generator=gen).to(torch.bfloat16)
    ints = lambda val: torch.full((m,), val, dtype=torch.int32, device=dev)  # noqa: E731
    flts = lambda val: torch.full((m,), val, dtype=torch.float32, device=dev)  # noqa: E731
    seeds = torch.randint(0, 2**62, (m,), device=dev, generator=gen)
    ctrs = torch.arange(m, device=dev, dtype=torch.int64) * 7
    check("sample cp", tk_sample._sample_kernel,
          lambda: [parts, ints(1), flts(0.9), ints(50), flts(0.8), seeds, ctrs, ints(0), ints(0).to(torch.uint8),
                   table, torch.empty(m, h, device=dev), torch.zeros(m, 17, dtype=torch.int32, device=dev), v,
                   parts.stride(1), parts.stride(0), 17, 3, 16, 2],
          dict(STREAM=3, BLOCK_V=v, PARTS=2, H=h, HP2=h, EMBED=True, INTO=True, INTERPRET=False, num_warps=8,
               **pdl.kw()), (m,), (7, 8, 10, 11))
    return out


def _record_launches(fn) -> list:
    """The Triton launches that fn() makes: (JITFunction, args, kwargs, grid) each, in order."""
    from triton.runtime.jit import JITFunction

    recs, real = [], JITFunction.run

    def run(self, *a, grid, warmup, **kw):
        if not warmup:
            recs.append((self, a, dict(kw), grid))
        return real(self, *a, grid=grid, warmup=warmup, **kw)

    JITFunction.run = run
    try:
        fn()
    finally:
        JITFunction.run = real
    torch.cuda.synchronize()
    return recs


def replay_section(dev, gen) -> list[dict]:
    """Whole ops of the talker step run as their Triton launches, then again with every launch made
    a device function of a CUDA kernel (scripts/ptx_func.py) on the same buffers, the tensors the
    launches changed put back first: the paged decode attention (bf16 pools, split on tensor cores,
    then the combine), the talker's q/k norm + RoPE + KV store, its logit processing (in place) and
    its draw. Every tensor must end bitwise as the Triton launches left it."""
    from tts_server.engines.batched import tk_attention, tk_glue, tk_sample

    workdir = Path(tempfile.mkdtemp())
    out = []

    def check(label, fn, mine):
        """mine: every tensor this script made that fn's launches read or write. The launches are
        recorded, then run twice from the same start, as Triton launches and as device functions:
        our tensors put back as they were, the buffers the op allocates itself filled with 0xFF
        bytes (so both runs see the same bytes where a launch reads what it did not write, e.g. a
        split the stream's length does not reach)."""
        before = [t.clone() for t in mine]
        recs = _record_launches(fn)
        own = {t.data_ptr() for t in mine}
        seen_ptrs, tensors = set(), []
        for _, a, _, _ in recs:
            for t in a:
                if isinstance(t, torch.Tensor) and t.data_ptr() not in seen_ptrs:
                    seen_ptrs.add(t.data_ptr())
                    tensors.append(t)
        changed = sum(not torch.equal(t.view(torch.uint8), x.view(torch.uint8)) for t, x in zip(mine, before))

        def reset():
            for t, x in zip(mine, before):
                t.copy_(x)
            for t in tensors:
                if t.data_ptr() not in own:
                    t.view(torch.uint8).fill_(0xFF)

        reset()
        for jitfn, a, kw, grid in recs:
            jitfn[grid](*a, **kw)
        torch.cuda.synchronize()
        after = [t.clone() for t in tensors]
        reset()
        kernels = []
        for n, (jitfn, a, kw, grid) in enumerate(recs):
            run, _, _ = _as_func(jitfn, list(a), kw, grid, f"tri_{label.replace(' ', '_')}_{n}", workdir)
            run(list(a))
            kernels.append(jitfn.fn.__name__)
        torch.cuda.synchronize()
        per = [int((t.view(torch.uint8) == y.view(torch.uint8)).sum()) for t, y in zip(tensors, after)]
        sizes = [t.numel() * t.element_size() for t in tensors]
        eq, n = sum(per), sum(sizes)
        rec = {"op": "triton_replay", "what": label, "kernels": kernels, "tensors": len(tensors),
               "own_changed": changed, "bytes_equal": eq, "bytes": n,
               "per_tensor": [[tuple(t.shape), str(t.dtype), e, z] for t, e, z in zip(tensors, per, sizes)]}
        out.append(rec)
        print(f"replayed as device functions: {label} ({', '.join(kernels)}; {len(tensors)} tensors, {changed} of "
              f"ours written in place): bytes equal {eq}/{n}", flush=True)
        if eq != n:
            for t, e, z in zip(tensors, per, sizes):
                print(f"    {tuple(t.shape)} {t.dtype}: {e}/{z}", flush=True)

    b, nh, nkv, hd, block, max_blocks = 17, 16, 8, 128, 64, 16
    lens = torch.randint(100, max_blocks * block, (b,), device=dev, generator=gen).to(torch.int32)
    table = torch.randperm(b * max_blocks, device=dev, generator=gen).to(torch.int32).view(b, max_blocks)
    kp = torch.randn(b * max_blocks, nkv, block, hd, device=dev, generator=gen).to(torch.bfloat16)
    vp = torch.randn(b * max_blocks, nkv, block, hd, device=dev, generator=gen).to(torch.bfloat16)
    q = torch.randn(b, nh, hd, device=dev, generator=gen)
    check("paged attention", lambda: tk_attention.paged_attention(q, kp, vp, table, lens, hd ** -0.5, torch.float16),
          [q, kp, vp, table, lens])
    qkv = torch.randn(b, (nh + 2 * nkv) * hd, device=dev, generator=gen)
    qn = (1.0 + 0.1 * torch.randn(hd, device=dev, generator=gen)).float()
    kn = (1.0 + 0.1 * torch.randn(hd, device=dev, generator=gen)).float()
    ang = torch.arange(hd // 2, device=dev, dtype=torch.float32)[None, :] * 0.01 * (lens[:, None].float())
    cos, sin = torch.cat([ang.cos(), ang.cos()], 1), torch.cat([ang.sin(), ang.sin()], 1)
    blk = table[torch.arange(b, device=dev), (lens // block).long()].contiguous()
    off = (lens % block).contiguous()
    check("qk rope store", lambda: tk_glue.qk_rope_store(qkv, qn, kn, cos, sin, kp, vp, blk, off, nh, nkv, 1e-6),
          [qkv, qn, kn, cos, sin, kp, vp, blk, off])
    v = 3072
    logits = 3.0 * torch.randn(b, v, device=dev, generator=gen)
    seen = (torch.rand(b, v, device=dev, generator=gen) < 0.02).to(torch.uint8)
    pen = torch.full((b,), 1.05, device=dev)
    nsamp = torch.randint(0, 40, (b,), device=dev, generator=gen).to(torch.int32)
    check("talker logits", lambda: tk_sample.talker_process_(logits, seen, pen, nsamp, 2150, 2048, 2),
          [logits, seen, pen, nsamp])
    ds, topk = torch.full((b,), 1, dtype=torch.int32, device=dev), torch.full((b,), 50, dtype=torch.int32, device=dev)
    temp, topp = torch.full((b,), 0.9, device=dev), torch.full((b,), 1.0, device=dev)
    seeds = torch.randint(0, 2**62, (b,), device=dev, generator=gen)
    ctr = torch.arange(b, device=dev, dtype=torch.int64) * 3
    box = torch.zeros(b, 17, dtype=torch.int32, device=dev)
    check("talker draw", lambda: tk_sample.sample_tokens(logits, ds, temp, topk, topp, seeds, ctr, 0,
                                                         into=(box, 0, 16, 1)),
          [logits, ds, temp, topk, topp, seeds, ctr, box])
    return out


def compiled_kernels() -> dict:
    """Every compiled specialisation of tk_gemm's GEMM kernel: key -> (num_warps, has wgmma)."""
    out = {}
    for entry in tk_gemm._gemm_kernel.device_caches.values():
        for key, k in entry[0].items():
            ptx = k.asm.get("ptx", "")
            out[str(key)] = (k.metadata.num_warps, "wgmma" in ptx, "mma.sync" in ptx)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--only", nargs="*", help="run only these sections (products add_rms rms_norm swiglu chain "
                                              "chain_smem triton_func replay); default all")
    a = ap.parse_args()
    want = lambda name: not a.only or name in a.only  # noqa: E731
    so = build()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    results = []
    for name, n, k in SHAPES if want("products") else ():
        # bf16 weights (the checkpoint's) converted to fp16 as params.py does; inputs ~ a normed row
        w = (torch.randn(n, k, device=dev, generator=gen) * 0.03).to(torch.bfloat16).to(torch.float16)
        for m in ROWS:
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.float16)
            before = compiled_kernels()
            tri = tk_gemm.linear_parts(x, w)  # [S, m, n]
            torch.cuda.synchronize()
            new = {key: v for key, v in compiled_kernels().items() if key not in before}
            bm, bn, bk, warps, stages, chunk, _ = tk_gemm.config("linear", n, k, m, fp16=True, x16=True)
            split, kper = tk_gemm._pieces(False, k, chunk, bk)
            ref = torch.empty((split, m, n), dtype=torch.float32, device=dev)
            err = so.dot_bits_parts_fp16(x.data_ptr(), w.data_ptr(), ref.data_ptr(), m, n, k, kper, _stream())
            torch.cuda.synchronize()
            assert err == 0, f"CUDA error {err}"
            exact = (x.double() @ w.double().T)
            same = _same_bits(tri, ref)
            rec = {"shape": name, "n": n, "k": k, "m": m, "tile": [bm, bn, bk, warps, stages], "pieces": split,
                   "piece_cols": kper, "values": tri.numel(), "bitwise_equal": same,
                   "max_abs_diff": float((tri - ref).abs().max()),
                   "triton_vs_fp64_max": float((tri.double().sum(0) - exact).abs().max()),
                   "cuda_vs_fp64_max": float((ref.double().sum(0) - exact).abs().max()),
                   "new_kernels": list(new.values())}
            results.append(rec)
            print(f"{name:10s} m={m:3d} tile={rec['tile']} pieces={split}x{kper} wgmma/mma={list(new.values())} "
                  f"equal {same}/{tri.numel()} maxdiff {rec['max_abs_diff']:.3g}", flush=True)
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__}
    sections = (("add_rms", lambda: add_rms_section(so, dev, gen)),
                ("rms_norm", lambda: rms_norm_section(so, dev, gen)),
                ("swiglu", lambda: swiglu_section(so, dev, gen)), ("chain", lambda: chain_section(so, dev)),
                ("chain_smem", lambda: chain_smem_section(so, dev)),
                ("triton_func", lambda: triton_func_section(dev, gen)), ("replay", lambda: replay_section(dev, gen)))
    for name, section in sections:  # one section's failure is recorded, and the rest still run
        if not want(name):
            continue
        try:
            results += section()
        except Exception as e:  # noqa: BLE001 - reported in the JSON and on stdout
            results.append({"op": name, "error": f"{type(e).__name__}: {e}"[:2000]})
            print(f"section {name} failed: {type(e).__name__}: {e}", flush=True)
            torch.cuda.synchronize()
        Path(a.out, "dot_bits.json").write_text(json.dumps({"env": env, "results": results}, indent=1))
    print(json.dumps(env))


if __name__ == "__main__":
    main()
