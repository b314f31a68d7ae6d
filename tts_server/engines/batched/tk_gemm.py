"""Batch-invariant skinny GEMMs (linear, fused SwiGLU) and RMSNorm in Triton. Each row's reduction
order depends on (N, K) only, never on M (the tile may). fp32 activations meet bf16 matrices as
two bf16 tensor-core dots (hi + lo parts), and fp16 matrices (params.gemm_dtype) as one dot of
the activations rounded to fp16."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import pdl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, K chunk, x terms) per GEMM kind. Each output
# element's reduction order is fixed by (BLOCK_K, K chunk, x terms) alone: K > chunk is split into
# ceil(K / chunk) fixed pieces summed in order (swiglu never splits: silu needs the full sum), and
# each piece walks K in BLOCK_K steps, x's bf16 hi part then its lo part (x terms: fp32 x as 2 or 3
# bf16 parts; fp16 matrices take x as one fp16 part instead, whatever the config says). Those three
# depend on (kind, N, K) only, never on M, which keeps every row's bits independent of the batch.
# BLOCK_M / BLOCK_N / warps / stages only decide which program computes an element, so they may
# follow M (measured bitwise equal on the H100 for every candidate tile,
# benchmarks/results/h100-gemm-tiles-*.json; the engine's invariance test crosses M buckets).
DEFAULT = {"linear": (16, 32, 128, 4, 4, 1024, 2), "swiglu": (16, 32, 128, 4, 4, 1 << 30, 2)}
# The 0.6B shapes on an H100: BLOCK_K / chunk / terms from the ops sweep
# (benchmarks/results/batched_ops_h100_run2.json, gemm_sweep), then per M bucket the fastest
# (BLOCK_M, BLOCK_N, warps, stages) of scripts/gpu_gemm_tiles.py (M <= 256) and, for the prefill's
# many rows, of scripts/gpu_gemm_big_m.py (M > 256: TUNED's tile; benchmarks/results/h100-gemm-big-m-*).
# The M <= 256 bucket's tiles from scripts/gpu_large_b_sweep.py (wider tiles: 10-17% faster at
# M = 256; benchmarks/results/h100-large-b-sweep-*.json).
TUNED: dict[tuple[str, int, int], tuple] = {
    ("linear", 4096, 1024): (128, 128, 128, 8, 3, 1024, 2),  # q|k|v
    ("linear", 1024, 2048): (128, 256, 64, 8, 3, 512, 2),    # o_proj (split-K 4)
    ("swiglu", 3072, 1024): (128, 64, 128, 8, 3, 1 << 30, 2),  # gate|up
    ("linear", 1024, 3072): (128, 256, 64, 8, 3, 512, 2),    # down (split-K 6)
    ("linear", 3072, 1024): (64, 64, 128, 4, 3, 1024, 2),    # codec head
    ("linear", 2048, 1024): (64, 64, 64, 4, 3, 512, 2),      # code-predictor heads (split-K 2)
}
# (max M, (BLOCK_M, BLOCK_N, num_warps, num_stages)) per shape, smallest M first; M above the
# last bound uses TUNED's tile
BY_M: dict[tuple[str, int, int], tuple] = {
    ("linear", 4096, 1024): ((16, (16, 16, 2, 3)), (32, (16, 64, 4, 5)), (64, (64, 32, 4, 4)), (128, (64, 64, 4, 3)),
                             (256, (64, 128, 4, 3))),
    ("linear", 1024, 2048): ((16, (16, 32, 4, 5)), (64, (16, 64, 2, 5)), (128, (64, 64, 4, 3)),
                             (512, (64, 128, 4, 3))),
    ("swiglu", 3072, 1024): ((16, (16, 32, 4, 3)), (32, (16, 64, 4, 5)), (64, (64, 32, 4, 4)), (128, (64, 64, 4, 3)),
                             (256, (128, 64, 8, 3))),
    ("linear", 1024, 3072): ((32, (16, 64, 2, 5)), (64, (64, 64, 4, 4)), (128, (64, 32, 4, 4)), (256, (64, 128, 4, 3))),
    ("linear", 3072, 1024): ((16, (16, 16, 2, 3)), (32, (16, 64, 4, 3)), (64, (64, 32, 4, 4))),
    ("linear", 2048, 1024): ((16, (16, 32, 4, 5)), (64, (16, 64, 2, 5))),
}
# The same for fp16 matrices (one x term: a tile's dot work halves, so other tiles win), the
# fastest bitwise-equal tiles of `DTYPE=fp16 scripts/gpu_gemm_tiles.py` on the H100
# (benchmarks/results/h100-gemm-tiles-fp16-*.json; µs per product, graph replays, weights past
# L2: q|k|v 6.4-7.1 -> 6.2 at 1-16 rows, gate|up 8.1 -> 7.2, the code-predictor heads 13.1 ->
# 10.1 at 256). Shapes not here use BY_M (down: its x is always fp16, see BY_M_X16).
BY_M_FP16: dict[tuple[str, int, int], tuple] = {
    ("linear", 4096, 1024): ((16, (16, 32, 4, 5)), (32, (16, 64, 2, 4)), (64, (64, 32, 4, 4)), (128, (64, 64, 4, 4)),
                             (256, (64, 128, 4, 4))),
    ("linear", 1024, 2048): ((16, (16, 32, 4, 5)), (32, (16, 64, 4, 5)), (64, (64, 32, 4, 4)), (128, (64, 64, 4, 4)),
                             (256, (64, 128, 4, 4)), (512, (64, 128, 4, 3))),
    ("swiglu", 3072, 1024): ((16, (16, 32, 4, 5)), (32, (16, 64, 4, 5)), (64, (64, 32, 4, 4)), (128, (64, 64, 4, 3)),
                             (256, (128, 64, 8, 3))),
    ("linear", 2048, 1024): ((16, (16, 32, 4, 5)), (32, (16, 64, 4, 5)), (64, (64, 32, 4, 4)), (128, (64, 64, 4, 4)),
                             (256, (64, 128, 4, 4))),
}
# The same for fp16 matrices whose x comes already rounded to fp16 by its producer (the decode
# frame's normed hidden states, rms_norm / add_rms with out_dtype fp16, and its attention outputs,
# ops.paged_attention / glue.cp_attend with out_dtype fp16). x is then half the bytes
# that every output tile re-reads; from 64 rows the products are bound by that L2 -> SM traffic.
# The fastest bitwise-equal tiles of scripts/gpu_gemm_presplit.py on an H200
# (benchmarks/results/h200-s31/gemm_x16_tiles.json; us per product, weights from HBM, x fp32 ->
# x fp16 with these tiles): q|k|v 6.2 -> 5.5 at 16 rows, 8.0 -> 5.5 at 64, 9.4 -> 6.4 at 128,
# 11.3 -> 8.6 at 256; gate|up 7.0 -> 6.3, 9.0 -> 7.0, 11.7 -> 8.5, 15.6 -> 11.8; the code-predictor
# heads 3.6 -> 3.2, 5.2 -> 3.6, 6.3 -> 4.5, 7.4 -> 6.2; o_proj (its input the attention's output,
# gemm_x16_tiles_o_proj.json) 3.8 -> 3.4, 5.3 -> 3.9, 6.8 -> 4.9, 8.0 -> 6.5. None: these rows take
# BY_M_FP16's tile (the sweep's fastest there too).
BY_M_X16: dict[tuple[str, int, int], tuple] = {
    ("linear", 1024, 2048): ((16, None), (64, (64, 32, 4, 4)), (128, (64, 64, 4, 4)), (512, None)),
    ("linear", 4096, 1024): ((16, None), (64, (64, 32, 4, 4)), (128, (64, 64, 4, 4)), (256, (128, 64, 8, 3))),
    ("swiglu", 3072, 1024): ((16, None), (64, (64, 32, 4, 4)), (128, (64, 64, 4, 4)), (256, (128, 64, 8, 3))),
    ("linear", 2048, 1024): ((16, None), (64, (64, 32, 4, 4)), (256, (64, 64, 4, 4))),
    # down, its x swiglu's scaled fp16 row (session 33, X16_SHAPES=down on an H200,
    # benchmarks/results/h200-s33/down16-tests-sweep/): 5.38 -> 5.17 us at 64 rows, and the B = 64
    # frame 4.93 -> 4.78 ms (two calls). The sweep's faster tiles at 1-16 rows (4.75 -> 4.28 us)
    # made those frames slower (3.03 -> 3.12 ms at B = 1), at 256 rows the frame was unchanged:
    # BY_M's tiles there
    ("linear", 1024, 3072): ((32, None), (64, (64, 32, 4, 4)), (256, None)),
}
# TUNED's MLP down projections (their fp16 input comes scaled: warm_up compiles that variant too)
MLP_DOWN = {("linear", 1024, 3072)}
# Opt-in (TTS_GEMM_SUB=256, with a small-batch kernel built with QSK_SUB=256 to match): the
# transformer layers' products with fp16 matrices sum each K piece as sub-pieces of that many
# columns, each from a zero accumulator, added in order (((0 + s0) + s1) + ..), part of every
# output's reduction order like the pieces (a function of (kind, N, K) alone, never of M). The
# small-batch kernel then runs two sub-pieces' mma.sync chains interleaved on a warp (its chains
# are latency-bound at one row: a 1,024-column piece is 64 dependent 16-column steps in one
# chain). Measured on an H200 (session 47, gpu_pdl_ab.py's sub variants, two rounds, ms a frame):
# B = 1 2.222 / 2.225 -> 2.135 / 2.129, but the Triton tiles lose what the fold costs them: B = 4
# 3.033 -> 3.075, 16 3.702 -> 3.749, 64 4.440 -> 4.829, 256 9.96 -> 10.47 (the same with the
# loop nest flattened or the fold inside one loop). Off (0: one chain a piece) by default.
SUB_SHAPES = {("linear", 4096, 1024), ("linear", 1024, 2048), ("swiglu", 3072, 1024), ("linear", 1024, 3072)}
SUB_COLS = 0


def sub_cols(kind: str, n: int, k: int, fp16: bool) -> int:
    """The sub-piece columns of this product's K pieces (0: none, one chain a piece)."""
    if not fp16 or (kind, n, k) not in SUB_SHAPES:
        return 0
    return int(os.environ.get("TTS_GEMM_SUB", SUB_COLS))


# one row count per tile bucket, for compiling every tile before serving (warm_up)
WARM_ROWS = (1, 17, 33, 65, 129, 257, 513)
OVERRIDE: dict[str, tuple] = {}


def config(kind: str, n: int, k: int, m: int = 1 << 30, fp16: bool = False, x16: bool = False) -> tuple:
    """The tile for an [m, k] x [k, n] GEMM of this kind (see TUNED / BY_M; fp16: the matrices
    are fp16, BY_M_FP16 where it has the shape; x16: x is fp16 too, BY_M_X16 where it has the
    shape and a tile for m)."""
    if kind in OVERRIDE:
        return OVERRIDE[kind]
    tuned = TUNED.get((kind, n, k))
    if tuned is None:
        return DEFAULT[kind]
    tables = ((BY_M_X16,) if fp16 and x16 else ()) + ((BY_M_FP16,) if fp16 else ()) + (BY_M,)
    for table in tables:
        if (kind, n, k) not in table:
            continue
        for max_m, tile in table[(kind, n, k)]:
            if m <= max_m:
                break
        else:
            return tuned  # more rows than the table's last bucket
        if tile is None:  # the table leaves these rows to the next one
            continue
        bm, bn, warps, stages = tile
        return (bm, bn, tuned[2], warps, stages) + tuned[5:]
    return tuned


def warm_up(device: torch.device, dtypes: tuple = (torch.bfloat16,), mlp_shift: int = 0) -> None:
    """Compile every tuned tile once for matrices of each of `dtypes` (a first compile while
    serving stalls a step for ~1 s); for fp16 matrices also with x in fp16, and (mlp_shift) the
    MLP's scaled pair: swiglu into fp16 times 2^-mlp_shift, the down projection undoing it."""
    for (kind, n, k) in TUNED:
        for dtype in dtypes:
            w = torch.zeros(n, k, dtype=dtype, device=device)
            fp16 = dtype == torch.float16
            for x_dtype in (torch.float32,) + ((torch.float16,) if fp16 else ()):
                for m in WARM_ROWS:
                    x = torch.zeros(m, k, dtype=x_dtype, device=device)
                    _gemm(x, w, w if kind == "swiglu" else None)
                    if fp16 and mlp_shift and kind == "swiglu":
                        swiglu(x, w, w, torch.float16, mlp_shift)
                    elif fp16 and mlp_shift and x_dtype == torch.float16 and (kind, n, k) in MLP_DOWN:
                        linear_parts(x, w, mlp_shift)


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    # bf16 [BM, BK] @ bf16 [BK, BN] + fp32 acc; the interpreter's bf16 dot multiplies raw bits, so
    # there the exact bf16 (fp16) values go through an fp64 dot (numpy's; products exact, the sum
    # of a K step exact for such values) added to acc and rounded once: an element's value does
    # not depend on the tile's shape (numpy's fp32 matmul, OpenBLAS 0.3.31, rounds by shape)
    if INTERPRET:
        d = tl.dot(a.to(tl.float64), b.to(tl.float64), tl.zeros(acc.shape, tl.float64), input_precision="ieee")
        return (d + acc.to(tl.float64)).to(tl.float32)
    return tl.dot(a, b, acc)


@triton.jit
def _scaled(acc, out_ptr, SCALE: tl.constexpr):
    # acc * SCALE (a power of two, so exact), rounded once to nearest even for an fp16 out
    if SCALE != 1.0:
        acc = acc * SCALE
    if out_ptr.dtype.element_ty == tl.float16:
        acc = acc.to(tl.float16, fp_downcast_rounding="rtne")
    return acc


@triton.jit
def _k_step(x_ptr, w_ptr, w2_ptr, rm, rn, rk, M, N, k0, k_hi, stride_xm, stride_wn, stride_w2n, acc, acc2,
            SWIGLU: tl.constexpr, TERMS: tl.constexpr, INTERPRET: tl.constexpr):
    # one BLOCK_K step of `_gemm_kernel`'s walk over K: the dots of columns k0.. into acc (acc2)
    kk = k0 + rk
    kmask = kk < k_hi
    xk = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :],
                 mask=(rm < M)[:, None] & kmask[None, :], other=0.0)
    wmask = (rn < N)[:, None] & kmask[None, :]  # weight tiles [BLOCK_N, BLOCK_K], K contiguous
    wk = tl.trans(tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=wmask, other=0.0))
    if TERMS == 0:  # fp16 matrices (params.gemm_dtype): x rounded once to fp16, one dot
        if x_ptr.dtype.element_ty == tl.float16:  # rounded by its producer already
            x_h = xk
        else:
            x_h = xk.to(tl.float16, fp_downcast_rounding="rtne")
        acc = _dot(x_h, wk, acc, INTERPRET)
        if SWIGLU:
            wk2 = tl.trans(tl.load(w2_ptr + rn[:, None] * stride_w2n + kk[None, :], mask=wmask,
                                   other=0.0))
            acc2 = _dot(x_h, wk2, acc2, INTERPRET)
    else:
        x_hi = xk.to(tl.bfloat16, fp_downcast_rounding="rtne")
        x_lo = (xk - x_hi.to(tl.float32)).to(tl.bfloat16, fp_downcast_rounding="rtne")
        if TERMS == 3:
            x_l2 = (xk - x_hi.to(tl.float32) - x_lo.to(tl.float32)).to(tl.bfloat16,
                                                                      fp_downcast_rounding="rtne")
        acc = _dot(x_hi, wk, acc, INTERPRET)
        acc = _dot(x_lo, wk, acc, INTERPRET)
        if TERMS == 3:
            acc = _dot(x_l2, wk, acc, INTERPRET)
        if SWIGLU:
            wk2 = tl.trans(tl.load(w2_ptr + rn[:, None] * stride_w2n + kk[None, :], mask=wmask,
                                   other=0.0))
            acc2 = _dot(x_hi, wk2, acc2, INTERPRET)
            acc2 = _dot(x_lo, wk2, acc2, INTERPRET)
            if TERMS == 3:
                acc2 = _dot(x_l2, wk2, acc2, INTERPRET)
    return acc, acc2


@triton.jit
def _k_walk(x_ptr, w_ptr, w2_ptr, rm, rn, rk, M, N, k_lo, k_hi, stride_xm, stride_wn, stride_w2n,
            SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            TERMS: tl.constexpr, INTERPRET: tl.constexpr, SUB: tl.constexpr):
    # a K piece (columns k_lo..k_hi) from zero, in BLOCK_K steps; SUB > 0: as sub-pieces of SUB
    # columns, each from zero, added to the piece's sum in order (k_hi - k_lo a multiple of SUB),
    # one loop nest flattened for the pipeliner (as slow on an H200 as a fold inside one loop)
    if SUB > 0:
        tot = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        tot2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s0 in tl.range(k_lo, k_hi, SUB, flatten=True):
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for i in range(0, SUB // BLOCK_K):
                acc, acc2 = _k_step(x_ptr, w_ptr, w2_ptr, rm, rn, rk, M, N, s0 + i * BLOCK_K, k_hi, stride_xm,
                                    stride_wn, stride_w2n, acc, acc2, SWIGLU, TERMS, INTERPRET)
            tot += acc
            if SWIGLU:
                tot2 += acc2
        acc, acc2 = tot, tot2
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            acc, acc2 = _k_step(x_ptr, w_ptr, w2_ptr, rm, rn, rk, M, N, k0, k_hi, stride_xm, stride_wn,
                                stride_w2n, acc, acc2, SWIGLU, TERMS, INTERPRET)
    return acc, acc2


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(x_ptr, w_ptr, w2_ptr, out_ptr, M, N, K, K_PER_SPLIT, stride_xm, stride_wn,
                 stride_w2n, stride_os, stride_om, SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TERMS: tl.constexpr,
                 INTERPRET: tl.constexpr, GDC: tl.constexpr, SCALE: tl.constexpr = 1.0, SUB: tl.constexpr = 0):
    pdl.enter(GDC)
    # x [M, K] fp32 (or fp16 with fp16 w); w, w2 [N, K] bf16 or fp16; out [SPLIT, M, N] fp32 (split s
    # covers K range s*K_PER_SPLIT..), each value times SCALE (a power of two: exact); an fp16 out
    # (swiglu) takes the scaled value rounded once to nearest even. SUB > 0: the piece as sub-pieces
    # of SUB columns (sub_cols), each from zero, added to the piece's sum in order
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_lo = pid_s * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    acc, acc2 = _k_walk(x_ptr, w_ptr, w2_ptr, rm, rn, rk, M, N, k_lo, k_hi, stride_xm, stride_wn, stride_w2n,
                        SWIGLU, BLOCK_M, BLOCK_N, BLOCK_K, TERMS, INTERPRET, SUB)
    if SWIGLU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc2
    acc = _scaled(acc, out_ptr, SCALE)
    omask = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(out_ptr + pid_s * stride_os + rm[:, None] * stride_om + rn[None, :], acc, mask=omask)


@triton.jit(do_not_specialize=["MN"])
def _sum_splits_kernel(part_ptr, out_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
    pdl.enter(GDC)
    # part [SPLIT, M*N] fp32 -> out [M*N] fp32, summed in split order 0..SPLIT-1
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc, mask=mask)


def _pieces(swiglu: bool, k: int, chunk: int, bk: int) -> tuple[int, int]:
    """The K pieces of a product (part of every output's reduction order) -> (count, columns
    each, a multiple of BLOCK_K). swiglu never splits: silu needs the full sum."""
    split = 1 if swiglu else triton.cdiv(k, chunk)
    k_per = triton.cdiv(triton.cdiv(k, split), bk) * bk
    return triton.cdiv(k, k_per), k_per


def _gemm(x: torch.Tensor, w: torch.Tensor, w2: torch.Tensor | None, reduce: bool = True, shift: int = 0,
          out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, K] fp32, w (, w2) [N, K] bf16 or fp16 -> [M, N] fp32 (x @ w.T, or silu(x @ w.T) * (x @ w2.T)).
    With fp16 matrices x may come as fp16 already (x rounded by its producer as this rounds fp32
    x: the same bits, half the bytes to read). reduce=False: the K pieces' partial products
    [SPLIT, M, N] instead (SPLIT may be 1), for the consumer to sum in piece order (glue.add_rms
    does: one launch fewer). shift: the result times 2^shift (exact); out_dtype fp16 (swiglu
    only): that rounded once to fp16."""
    assert w.dtype in (torch.bfloat16, torch.float16), w.dtype
    assert x.dtype == torch.float32 or (x.dtype == w.dtype == torch.float16), (x.dtype, w.dtype)
    x = x.contiguous()
    w = w.contiguous()
    m, k = x.shape
    n = w.shape[0]
    swiglu = w2 is not None
    w2 = w2.contiguous() if swiglu else w
    kind = "swiglu" if swiglu else "linear"
    fp16 = w.dtype == torch.float16
    bm, bn, bk, warps, stages, chunk, terms = config(kind, n, k, m, fp16=fp16, x16=x.dtype == torch.float16)
    if fp16:  # fp16 matrices (params.gemm_dtype): one fp16 term
        terms = 0
    assert out_dtype == torch.float32 or (swiglu and out_dtype == torch.float16), out_dtype
    if m >= big_m_min_rows(terms) and not OVERRIDE and (kind, n, k) in big_m_tiles(terms):
        # the same bits, for many rows
        out = gemm_big(x, w, w2 if swiglu else None, shift=shift, out_dtype=out_dtype)
        return out if reduce else out[None]
    split, k_per = _pieces(swiglu, k, chunk, bk)
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    part = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    _gemm_kernel[grid](x, w, w2, part, m, n, k, k_per, x.stride(0), w.stride(0), w2.stride(0),
                       m * n, n, SWIGLU=swiglu, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                       TERMS=terms, INTERPRET=_INTERPRET, num_warps=warps, num_stages=stages, **pdl.kw(),
                       **_scale_kw(shift), **_sub_kw(kind, n, k, fp16, bk, k_per))
    if not reduce:
        return part if split > 1 else out[None]
    if split > 1:
        blk = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, blk),)](part, out, m * n, SPLIT=split, BLOCK=blk, **pdl.kw())
    return out


def _scale_kw(shift: int) -> dict:
    """The kernels' SCALE (2^shift) where it is not 1: other launches keep their compiled form."""
    return dict(SCALE=2.0 ** shift) if shift else {}


def _sub_kw(kind: str, n: int, k: int, fp16: bool, bk: int, k_per: int) -> dict:
    """The kernels' SUB (sub_cols) where it is not 0: other launches keep their compiled form."""
    sub = sub_cols(kind, n, k, fp16)
    if not sub:
        return {}
    assert sub % bk == 0 and k_per % sub == 0, (kind, n, k, sub, bk, k_per)
    return dict(SUB=sub)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 (fp16 with fp16 w), w [N, K] bf16 or fp16 -> [M, N] fp32."""
    return _gemm(x, w, None)


def linear_parts(x: torch.Tensor, w: torch.Tensor, x_shift: int = 0) -> torch.Tensor:
    """x [M, K] fp32 (fp16 with fp16 w), w [N, K] bf16 or fp16 -> partial products [SPLIT, M, N]
    fp32 whose in-order sum is `linear(x, w)` bitwise; x_shift: x is the input times 2^-x_shift
    (see swiglu), and the products come back times 2^x_shift."""
    return _gemm(x, w, None, reduce=False, shift=x_shift)


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, out_dtype: torch.dtype = torch.float32,
           shift: int = 0) -> torch.Tensor:
    """x [M, K] fp32 (fp16 with fp16 w), w_* [I, K] bf16 or fp16 -> silu(x @ w_gate.T) * (x @ w_up.T)
    [M, I] fp32; out_dtype fp16: that times 2^-shift, rounded once to fp16 (see ops.swiglu)."""
    return _gemm(x, w_gate, w_up, shift=-shift, out_dtype=out_dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, eps, stride_xm, stride_om, BLOCK_D: tl.constexpr, GDC: tl.constexpr):
    pdl.enter(GDC)
    # one program per row: x [D] fp32, w [D] -> out [D] fp32
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps)
    y = w * (x * r)
    if out_ptr.dtype.element_ty == tl.float16:  # for fp16 matrices: rounded as _gemm_kernel rounds
        y = y.to(tl.float16, fp_downcast_rounding="rtne")
    tl.store(out_ptr + row * stride_om + offs, y, mask=mask)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, D] fp32, w [D] -> [M, D] fp32, or that rounded to fp16 (out_dtype) for products
    with fp16 matrices."""
    assert x.dtype == torch.float32 and x.stride(-1) == 1 and out_dtype in (torch.float32, torch.float16)
    m, d = x.shape
    out = torch.empty((m, d), dtype=out_dtype, device=x.device)
    _rms_norm_kernel[(m,)](x, w.contiguous(), out, d, float(eps), x.stride(0), out.stride(0),
                           BLOCK_D=triton.next_power_of_2(d), num_warps=4, **pdl.kw())
    return out


# ---- many rows (the prefill): x split once, K pieces summed in the program ----------------------
# The same value as `_gemm` + its split sum, bit for bit: x's bf16 hi / lo parts (fp16 matrices:
# x rounded to fp16, one part) are computed once (`_split_kernel`, the same roundings as
# `_gemm_kernel`'s) instead of once per output tile, and one program walks all of an output
# tile's K pieces, each from a zero accumulator over BLOCK_K steps (hi dot then lo dot), adding
# the pieces in order as `_sum_splits_kernel` and `add_rms` do. For M in the thousands the split
# buys no parallelism, and its partial products cost a write and a read of SPLIT x M x N fp32.
# 2-term (bf16 matrices) and 0-term (fp16 matrices) configs.
# (kind, N, K) -> (BLOCK_M, BLOCK_N, warps, stages): the fastest bitwise-equal tile at M = 4096 of
# scripts/gpu_gemm_big.py on the H100 (benchmarks/results/h100-gemm-big-*.json); with the split,
# 10-30% less time per product than `_gemm` + its partial products from M = 2048 (the prefill's
# row buckets 2048..4096; below, `_gemm` was as fast or faster)
BIG_M: dict[tuple[str, int, int], tuple] = {
    ("linear", 4096, 1024): (128, 128, 8, 2),   # q|k|v: 174 vs 194 us at M = 4096
    ("linear", 1024, 2048): (128, 128, 8, 3),   # o_proj: 103 vs 86 + 3 more parts to read
    ("swiglu", 3072, 1024): (64, 128, 4, 2),    # gate|up: 236 vs 259
    ("linear", 1024, 3072): (128, 128, 8, 3),   # down: 149 vs 125 + 5 more parts to read
}
BIG_M_MIN_ROWS = 2048  # rows from which `_gemm` takes this path
# The same for fp16 matrices (x one fp16 part: half the shared memory of the hi / lo pair, so
# other tiles fit): `DTYPE=fp16 scripts/gpu_gemm_big.py` on the H100, fastest bitwise-equal tile
# at M = 4096 (benchmarks/results/h100-gemm-big-fp16-*.json); split + product vs `_gemm`, µs at
# M = 1024 / 4096. o_proj stays on `_gemm` (its fp32 input is twice as wide: 48.7 + 18.7 split
# against 61.5 for `_gemm`'s partial products at 4096). From 1024 rows (at 512 gate|up lost).
BIG_M_FP16: dict[tuple[str, int, int], tuple] = {
    ("linear", 4096, 1024): (128, 128, 4, 3),  # q|k|v: 28.9 vs 42.7; 98.5 vs 158.8
    ("swiglu", 3072, 1024): (128, 64, 4, 3),   # gate|up: 42.0 vs 44.8; 136.2 vs 170.1
}
BIG_M_FP16_MIN_ROWS = 1024


def big_m_tiles(terms: int) -> dict:
    """The many-row path's tiles for a config's x terms (2: bf16 matrices, 0: fp16); {} for others."""
    return BIG_M if terms == 2 else BIG_M_FP16 if terms == 0 else {}


def big_m_min_rows(terms: int) -> int:
    return BIG_M_FP16_MIN_ROWS if terms == 0 else BIG_M_MIN_ROWS


@triton.jit
def _split_kernel(x_ptr, out_ptr, NUMEL, TERMS: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
    pdl.enter(GDC)
    # x [NUMEL] fp32 -> out [2, NUMEL] bf16: hi = rtne(x), lo = rtne(x - hi); TERMS 0: out [1,
    # NUMEL] fp16 = rtne(x)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NUMEL
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if TERMS == 0:
        tl.store(out_ptr + offs, x.to(tl.float16, fp_downcast_rounding="rtne"), mask=mask)
    else:
        hi = x.to(tl.bfloat16, fp_downcast_rounding="rtne")
        lo = (x - hi.to(tl.float32)).to(tl.bfloat16, fp_downcast_rounding="rtne")
        tl.store(out_ptr + offs, hi, mask=mask)
        tl.store(out_ptr + NUMEL + offs, lo, mask=mask)


@triton.jit
def _piece(hi_ptr, lo_ptr, w_ptr, w2_ptr, rm, rn, rk, M, N, k_lo, k_hi, stride_xm, stride_wn, stride_w2n,
           SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           TERMS: tl.constexpr, INTERPRET: tl.constexpr, SUB: tl.constexpr):
    # TERMS 2: hi / lo bf16 parts, two dots per K step; TERMS 0: hi is x in fp16 (lo unused), one dot;
    # SUB > 0 (fp16 matrices): `_gemm_kernel`'s walk over sub-pieces
    if SUB > 0:
        tl.static_assert(TERMS == 0, "sub-pieces: fp16 matrices")
        acc, acc2 = _k_walk(hi_ptr, w_ptr, w2_ptr, rm, rn, rk, M, N, k_lo, k_hi, stride_xm, stride_wn, stride_w2n,
                            SWIGLU, BLOCK_M, BLOCK_N, BLOCK_K, TERMS, INTERPRET, SUB)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kk = k0 + rk
            kmask = kk < k_hi
            xm = (rm < M)[:, None] & kmask[None, :]
            x_hi = tl.load(hi_ptr + rm[:, None] * stride_xm + kk[None, :], mask=xm, other=0.0)
            if TERMS == 2:  # the loads in the order the 2-term kernel was measured with
                x_lo = tl.load(lo_ptr + rm[:, None] * stride_xm + kk[None, :], mask=xm, other=0.0)
            wmask = (rn < N)[:, None] & kmask[None, :]
            wk = tl.trans(tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=wmask, other=0.0))
            acc = _dot(x_hi, wk, acc, INTERPRET)
            if TERMS == 2:
                acc = _dot(x_lo, wk, acc, INTERPRET)
            if SWIGLU:
                wk2 = tl.trans(tl.load(w2_ptr + rn[:, None] * stride_w2n + kk[None, :], mask=wmask, other=0.0))
                acc2 = _dot(x_hi, wk2, acc2, INTERPRET)
                if TERMS == 2:
                    acc2 = _dot(x_lo, wk2, acc2, INTERPRET)
    return acc, acc2


@triton.jit(do_not_specialize=["M"])
def _gemm_big_kernel(hi_ptr, lo_ptr, w_ptr, w2_ptr, out_ptr, M, N, K, K_PER_SPLIT, SPLIT, stride_xm, stride_wn,
                     stride_w2n, stride_om, SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, TERMS: tl.constexpr, INTERPRET: tl.constexpr, GDC: tl.constexpr,
                     SCALE: tl.constexpr = 1.0, SUB: tl.constexpr = 0):
    pdl.enter(GDC)
    # hi/lo [M, K] bf16 (x's parts; TERMS 0: hi = x in fp16); w, w2 [N, K] bf16 (fp16) -> out
    # [M, N] fp32: the K pieces (K_PER_SPLIT each) from zero, summed in order
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    y, y2 = _piece(hi_ptr, lo_ptr, w_ptr, w2_ptr, rm, rn, rk, M, N, 0, tl.minimum(K_PER_SPLIT, K), stride_xm,
                   stride_wn, stride_w2n, SWIGLU, BLOCK_M, BLOCK_N, BLOCK_K, TERMS, INTERPRET, SUB)
    for s in range(1, SPLIT):
        k_lo = s * K_PER_SPLIT
        p, _ = _piece(hi_ptr, lo_ptr, w_ptr, w2_ptr, rm, rn, rk, M, N, k_lo, tl.minimum(k_lo + K_PER_SPLIT, K),
                      stride_xm, stride_wn, stride_w2n, False, BLOCK_M, BLOCK_N, BLOCK_K, TERMS, INTERPRET, SUB)
        y += p
    if SWIGLU:
        y = y / (1.0 + tl.exp(-y)) * y2
    y = _scaled(y, out_ptr, SCALE)
    omask = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], y, mask=omask)


def split_parts(x: torch.Tensor, terms: int = 2) -> torch.Tensor:
    """x [M, K] fp32 -> [2, M, K] bf16: its hi and lo parts, as `_gemm_kernel` rounds them;
    terms 0 (fp16 matrices): [1, M, K] fp16, x rounded as `_gemm_kernel` rounds it."""
    x = x.contiguous()
    shape = (2 if terms == 2 else 1,) + tuple(x.shape)
    out = torch.empty(shape, dtype=torch.bfloat16 if terms == 2 else torch.float16, device=x.device)
    blk = 2048
    _split_kernel[(triton.cdiv(x.numel(), blk),)](x, out, x.numel(), TERMS=terms, BLOCK=blk, **pdl.kw())
    return out


def gemm_big(x: torch.Tensor, w: torch.Tensor, w2: torch.Tensor | None, tile: tuple | None = None,
             parts: torch.Tensor | None = None, shift: int = 0, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`_gemm(x, w, w2)` (reduced) bitwise, through split_parts and one program per output tile
    over all K pieces. tile: (BLOCK_M, BLOCK_N, warps, stages), default BIG_M's (BIG_M_FP16's for
    fp16 matrices) or TUNED's. parts: x's split_parts when the caller has them (one split for
    several products of x). shift / out_dtype: as `_gemm`'s."""
    m, k = x.shape
    n = w.shape[0]
    swiglu = w2 is not None
    kind = "swiglu" if swiglu else "linear"
    bm, bn, bk, warps, stages, chunk, terms = config(kind, n, k)
    if w.dtype == torch.float16:  # as `_gemm`: fp16 matrices take x as one fp16 part
        terms = 0
    assert terms in (0, 2), "the pre-split path is for 2-term configs and fp16 matrices"
    if tile is None:
        tile = big_m_tiles(terms).get((kind, n, k), (bm, bn, warps, stages))
    bm, bn, warps, stages = tile
    split, k_per = _pieces(swiglu, k, chunk, bk)
    if parts is None and x.dtype == torch.float16:  # rounded by its producer: x is its one part
        assert terms == 0, "fp16 x is for fp16 matrices"
        parts = x.contiguous()[None]
    hl = split_parts(x, terms) if parts is None else parts
    w = w.contiguous()
    w2 = w2.contiguous() if swiglu else w
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
    _gemm_big_kernel[grid](hl[0], hl[-1], w, w2, out, m, n, k, k_per, split, k, w.stride(0), w2.stride(0), n,
                           SWIGLU=swiglu, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, TERMS=terms, INTERPRET=_INTERPRET,
                           num_warps=warps, num_stages=stages, **pdl.kw(), **_scale_kw(shift),
                           **_sub_kw(kind, n, k, w.dtype == torch.float16, bk, k_per))
    return out
