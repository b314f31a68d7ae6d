"""Batch-invariant attention in Triton. Decode: paged attention with fixed-size position splits per
(row, kv head), combined in split order; the split size depends on the page size only, never on B or
the context. Prefill: causal attention of a step's prompts by query blocks of one prompt."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from . import pdl
from .ops import PREFILL_QB
from .tk_gemm import _dot

if TYPE_CHECKING:
    from .attn_kernel import DecodeSplit


_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# the prefill attention's dots: fp32 accuracy on tensor cores (3 tf32 products); the interpreter
# has no tf32, so there exact fp32
PRECISION: tl.constexpr = tl.constexpr("ieee" if _INTERPRET else "tf32x3")

# (positions per split, num_warps) by KV element size; from the pool's dtype alone, never from B
# or the context. A split is one tile of whole pages; splits are merged in order. OVERRIDE: sweeps.
CONFIG = {2: (64, 4), 4: (64, 4)}
OVERRIDE: dict[int, tuple[int, int]] = {}
# bf16 pools: the split's two products on tensor cores (TC_TERMS bf16 parts of the fp32 q and of
# the softmax weights: 3 parts would hold an fp32 value exactly; 2 hold 16 significant bits, a
# relative error of at most 2^-17 per value, ~250x below the bf16 rounding of the stored K/V
# that they multiply, and ~5% faster at B = 256 (one dot in three fewer per product; H200
# probes: 173 -> 165 and 177 -> 166 us a layer, benchmarks/results/h200-s3{1,2}/); the tensor
# cores' fp32 sums round a little more coarsely than the CUDA cores'). 1.6-1.7x faster than the
# CUDA-core kernel at B >= 64 (benchmarks/results/h100-attention-*.json). TTS_ATTN_TC_TERMS (2
# or 3, read per call): A/B variants. Splits per program (SPP) by batch size: a program walks
# SPP consecutive splits of one (row, kv head), each split's math and stores unchanged, so the
# bits do not depend on SPP (measured bitwise across 1 / 4 / 8) and SPP may follow B; fewer
# programs find nothing to do. A walk of several splits is software-pipelined
# in 2 stages (the next split's K/V loads in flight during this one's math; instruction order
# only, so no bits move either). (max B, SPP, stages), from the same sweep: B = 256 at mixed
# contexts 240 -> 214 us a layer with the 2 stages; B = 32 with (2, 2): 32.9 -> 31.3 us (H200,
# benchmarks/results/h200-s32/attn_probe_spp.json, where 1 / 1 stayed best up to 16 rows and
# 4 / 2 at 64 and 128).
TC_TERMS = 2
# grids of at least this many rows in (kv head, row, c) order: the programs launched together then
# read one page's kv heads, side by side in the pool. The same programs, so the same bits at any
# B. Same-call A/Bs on an H200 (benchmarks/results/h200-s32/): B = 256 frames 0.6-0.7% faster,
# B = 128 0.3-0.4% slower, B <= 64 within 0.2%. TTS_ATTN_KV_MAJOR=0 (read per call): never.
KV_MAJOR_MIN_B = 129
SPP_BY_B: tuple[tuple[int, int, int], ...] = ((16, 1, 1), (32, 2, 2), (128, 4, 2), (1 << 30, 8, 2))
# (max B, Z): above 16 rows a row's splits are walked by Z programs in turn (program c: splits c,
# c + Z, c + 2Z, ...; STRIDED) instead of in SPP-long runs: every program of a row gets a share,
# so a row's work spreads evenly over Z programs. Each split's math and stores are unchanged, so
# the bits are too (checked against the default walk in the probe and in test_batched_ops). Z = 0:
# SPP runs. Stages from SPP_BY_B. Split + merge, graph replays on an H200 at mixed contexts
# (benchmarks/results/h200-s43/): B = 32 31.1 -> 27.6 us a layer (Z = 8), B = 64 50.8 -> 46.4
# (Z = 8), B = 128 94.3 -> 85.1 (Z = 4), B = 256 170.0 -> 155.9 (Z = 4, kv head major), B = 256 at
# 1,000 positions 311 -> 288; at B <= 16 every Z was slower than one split a program (B = 16
# 15.7 -> 15.9 at best). Frames (gpu_frames_ab.sh, two rounds, the same codes and hidden states):
# B = 32 / 64 / 128 / 256 4.096 / 4.688 / 6.643 / 10.711 -> 3.974 / 4.573 / 6.395 / 10.310 ms.
STRIDE_BY_B: tuple[tuple[int, int], ...] = ((16, 0), (64, 8), (1 << 30, 4))
TENSOR_CORES = os.environ.get("TTS_ATTN_TC", "1") != "0"
# a split no longer than the block table (the code predictor's first pass: 1 page of 16 positions
# and <= 2 keys, where a 64-position split is 4x the work). A call site's table width never
# depends on B, so this keeps the invariance; and with <= 2 keys the padding keys only add exact
# zeros, so the first pass keeps its bits (scripts/gpu_large_b_sweep.py checks it)
CAP_SPLIT_TO_TABLE = True


def attn_config(kv_bytes: int, block: int) -> tuple[int, int]:
    """-> (pages per split, num_warps)."""
    pos, warps = OVERRIDE.get(kv_bytes) or CONFIG[kv_bytes]
    return max(1, triton.cdiv(pos, block)), warps


def _by_rows(table: tuple[tuple[int, ...], ...], b: int) -> tuple[int, ...]:
    """The settings of the first (max B, settings...) entry with b <= max B (else the last's)."""
    return next((row[1:] for row in table if b <= row[0]), table[-1][1:])


def splits_per_program(b: int) -> tuple[int, int]:
    """-> (splits per program, pipelining stages) for a batch of b rows."""
    spp, stages = _by_rows(SPP_BY_B, b)
    return spp, stages


def strided_programs(b: int) -> int:
    """-> Z, the programs that walk a row's splits in turn for a batch of b rows (0: SPP runs)."""
    return _by_rows(STRIDE_BY_B, b)[0]


@triton.jit
def _parts_dot(a, b, acc, TERMS: tl.constexpr, INTERPRET: tl.constexpr):
    # acc + a @ b for fp32 a [M, K] and bf16 b [K, N]: a as TERMS bf16 parts, largest first
    a1 = a.to(tl.bfloat16, fp_downcast_rounding="rtne")
    r = a - a1.to(tl.float32)
    acc = _dot(a1, b, acc, INTERPRET)
    a2 = r.to(tl.bfloat16, fp_downcast_rounding="rtne")
    acc = _dot(a2, b, acc, INTERPRET)
    if TERMS == 3:
        a3 = (r - a2.to(tl.float32)).to(tl.bfloat16, fp_downcast_rounding="rtne")
        acc = _dot(a3, b, acc, INTERPRET)
    return acc


@triton.jit
def _attn_split_tc_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, len_ptr, m_ptr, l_ptr, acc_ptr, scale,
                          MAX_BLOCKS, NSPLIT, NKV: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr,
                          PPS: tl.constexpr, HD: tl.constexpr, SPP: tl.constexpr, QR: tl.constexpr,
                          TERMS: tl.constexpr, STAGES: tl.constexpr, INTERPRET: tl.constexpr,
                          GDC: tl.constexpr, KV_MAJOR: tl.constexpr = False, STRIDED: tl.constexpr = False):
    pdl.enter(GDC)
    # program (b, kv head, c): splits c*SPP .. c*SPP+SPP-1 (those holding positions) of row b for
    # the G query heads of this kv head (padded to QR rows for the tensor cores) -> per split the
    # partial max m, sum l and unnormalised acc [HD] per query head, as _attn_split_kernel.
    # KV_MAJOR: the grid is (kv head, b, c) (see KV_MAJOR_MIN_B). STRIDED: splits c, c + Z,
    # c + 2Z, ... for a grid of Z programs a row (SPP unused), so that short rows spread over
    # more programs.
    if KV_MAJOR:
        kvh = tl.program_id(0)
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1)
    c = tl.program_id(2)
    n = tl.load(len_ptr + b)
    SPLIT_LEN: tl.constexpr = PPS * BLOCK
    used = (n + SPLIT_LEN - 1) // SPLIT_LEN
    if STRIDED:
        first = c
        last = used
        step = tl.num_programs(2)
    else:
        first = c * SPP
        last = tl.minimum(first + SPP, used)
        step = 1
    if first >= used:
        return
    g = tl.arange(0, QR)
    gmask = g < G
    d = tl.arange(0, HD)
    j = tl.arange(0, SPLIT_LEN)
    qrow = b * NKV * G + kvh * G + g  # [QR] (b, head) rows of q / m / l / acc
    q = tl.load(q_ptr + qrow[:, None] * HD + d[None, :], mask=gmask[:, None], other=0.0)  # [QR, HD]
    for sp in tl.range(first, last, step, num_stages=STAGES):
        pos = sp * SPLIT_LEN + j
        pmask = pos < n
        page = tl.load(bt_ptr + b * MAX_BLOCKS + sp * PPS + j // BLOCK, mask=pmask, other=0)
        row_off = ((page.to(tl.int64) * NKV + kvh) * BLOCK + j % BLOCK) * HD
        k = tl.load(k_ptr + row_off[:, None] + d[None, :], mask=pmask[:, None], other=0.0)  # [S, HD]
        v = tl.load(v_ptr + row_off[:, None] + d[None, :], mask=pmask[:, None], other=0.0)
        s = _parts_dot(q, tl.trans(k), tl.zeros((QR, SPLIT_LEN), tl.float32), TERMS, INTERPRET) * scale
        s = tl.where(pmask[None, :], s, float("-inf"))
        m = tl.max(s, axis=1)  # [QR]
        p = tl.exp(s - m[:, None])
        acc = _parts_dot(p, v, tl.zeros((QR, HD), tl.float32), TERMS, INTERPRET)  # [QR, HD]
        o = qrow * NSPLIT + sp
        tl.store(m_ptr + o, m, mask=gmask)
        tl.store(l_ptr + o, tl.sum(p, axis=1), mask=gmask)
        tl.store(acc_ptr + o[:, None] * HD + d[None, :], acc, mask=gmask[:, None])


@triton.jit
def _attn_split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, len_ptr, m_ptr, l_ptr, acc_ptr, scale,
                       MAX_BLOCKS, NSPLIT, NKV: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr,
                       PPS: tl.constexpr, HD: tl.constexpr, HD_P2: tl.constexpr, GDC: tl.constexpr):
    pdl.enter(GDC)
    # program (b, kv head, split): positions [split*PPS*BLOCK, +PPS*BLOCK) of row b for the G query
    # heads of this kv head -> partial max m, sum l, unnormalised acc [HD] per query head.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    n = tl.load(len_ptr + b)
    start = sp * PPS * BLOCK
    if start >= n:
        return
    j = tl.arange(0, PPS * BLOCK)
    pos = start + j
    pmask = pos < n
    page = tl.load(bt_ptr + b * MAX_BLOCKS + sp * PPS + j // BLOCK, mask=pmask, other=0)
    d = tl.arange(0, HD_P2)
    dmask = d < HD
    row_off = ((page.to(tl.int64) * NKV + kvh) * BLOCK + j % BLOCK) * HD
    kvmask = pmask[:, None] & dmask[None, :]
    k = tl.load(k_ptr + row_off[:, None] + d[None, :], mask=kvmask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + row_off[:, None] + d[None, :], mask=kvmask, other=0.0).to(tl.float32)
    for g in tl.static_range(G):
        h = kvh * G + g
        q = tl.load(q_ptr + (b * NKV * G + h) * HD + d, mask=dmask, other=0.0)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(pmask, s, float("-inf"))
        m = tl.max(s, axis=0)
        p = tl.exp(s - m)
        o = ((b * NKV * G + h) * NSPLIT + sp)
        tl.store(m_ptr + o, m)
        tl.store(l_ptr + o, tl.sum(p, axis=0))
        tl.store(acc_ptr + o * HD + d, tl.sum(p[:, None] * v, axis=0), mask=dmask)


@triton.jit
def _attn_combine_kernel(m_ptr, l_ptr, acc_ptr, len_ptr, out_ptr, NH, NSPLIT,
                         SPLIT_LEN: tl.constexpr, HD: tl.constexpr, HD_P2: tl.constexpr, GDC: tl.constexpr):
    pdl.enter(GDC)
    # program (b, h): the used splits of row b, head h, merged in split order -> out [HD]
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(len_ptr + b)
    used = (n + SPLIT_LEN - 1) // SPLIT_LEN
    d = tl.arange(0, HD_P2)
    dmask = d < HD
    base = (b * NH + h) * NSPLIT
    m = tl.full((), float("-inf"), tl.float32)
    l = tl.zeros((), tl.float32)
    acc = tl.zeros((HD_P2,), tl.float32)
    for s in range(0, used):
        ms = tl.load(m_ptr + base + s)
        m_new = tl.maximum(m, ms)
        a_old = tl.exp(m - m_new)
        a_new = tl.exp(ms - m_new)
        l = l * a_old + tl.load(l_ptr + base + s) * a_new
        acc = acc * a_old + tl.load(acc_ptr + (base + s) * HD + d, mask=dmask, other=0.0) * a_new
        m = m_new
    out = tl.where(used > 0, acc / tl.where(used > 0, l, 1.0), 0.0)
    if out_ptr.dtype.element_ty == tl.float16:  # for an o_proj with fp16 matrices: rounded as it rounds x
        out = out.to(tl.float16, fp_downcast_rounding="rtne")
    tl.store(out_ptr + (b * NH + h) * HD + d, out, mask=dmask)


def use_tensor_cores(k_pool: torch.Tensor, hd: int, split_len: int) -> bool:
    """The tensor-core split kernel: bf16 pools (fp32 pools keep the CUDA-core kernel, their keys
    are not bf16-exact), power-of-two head dims and splits of >= 16 positions."""
    return (TENSOR_CORES and k_pool.dtype == torch.bfloat16 and hd >= 16 and hd & (hd - 1) == 0
            and split_len >= 16)


# The persistent CUDA split (attn_kernel.DecodeSplit, the same bits) by device index, where the
# engine's start-up check found it equal (BatchedEngine); paged_attention uses it for the steps it
# serves. Empty: Triton alone.
CUDA_SPLIT: dict[int, DecodeSplit] = {}


def split_geometry(k_pool: torch.Tensor, max_blocks: int) -> tuple[int, int, int]:
    """-> (pages per split, num_warps, splits a row) for a pool and a table width."""
    pps, warps = attn_config(k_pool.element_size(), k_pool.shape[2])
    if CAP_SPLIT_TO_TABLE:
        pps = min(pps, triton.next_power_of_2(max_blocks))  # both powers of two
    return pps, warps, triton.cdiv(max_blocks, pps)


def split_into(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, bt: torch.Tensor, lens: torch.Tensor,
               m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, scale: float,
               cuda: DecodeSplit | None = None) -> None:
    """The split step of paged_attention (contiguous inputs): m, l [B, NH, NSPLIT] and acc [B, NH,
    NSPLIT, HD] of every used split, by the CUDA kernel `cuda` where it serves the call, else by
    the Triton kernels."""
    b, nh, hd = q.shape
    nkv, block = k_pool.shape[1], k_pool.shape[2]
    max_blocks = bt.shape[1]
    pps, warps, nsplit = split_geometry(k_pool, max_blocks)
    if cuda is not None and cuda.serves(q, k_pool, pps):
        cuda(q, k_pool, v_pool, bt, lens, m, l, acc, scale)
    elif use_tensor_cores(k_pool, hd, pps * block):
        spp, stages = splits_per_program(b)
        z = min(strided_programs(b), nsplit)
        kv_major = b >= KV_MAJOR_MIN_B and os.environ.get("TTS_ATTN_KV_MAJOR", "1") != "0"
        terms = int(os.environ.get("TTS_ATTN_TC_TERMS", TC_TERMS))
        assert terms in (2, 3), terms
        zg = z or triton.cdiv(nsplit, spp)
        _attn_split_tc_kernel[(nkv, b, zg) if kv_major else (b, nkv, zg)](
            q, k_pool, v_pool, bt, lens, m, l, acc, float(scale), max_blocks, nsplit, NKV=nkv, G=nh // nkv,
            BLOCK=block, PPS=pps, HD=hd, SPP=spp, QR=max(16, triton.next_power_of_2(nh // nkv)),
            TERMS=terms, STAGES=stages, INTERPRET=_INTERPRET, num_warps=warps, KV_MAJOR=kv_major,
            STRIDED=z > 0, **pdl.kw())
    else:
        _attn_split_kernel[(b, nkv, nsplit)](q, k_pool, v_pool, bt, lens, m, l, acc, float(scale),
                                             max_blocks, nsplit, NKV=nkv, G=nh // nkv, BLOCK=block,
                                             PPS=pps, HD=hd, HD_P2=triton.next_power_of_2(hd), num_warps=warps,
                                             **pdl.kw())


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [B, NH, HD] fp32; k_pool/v_pool [NUM_BLOCKS, NKV, BLOCK, HD]; block_table [B, MAX_BLOCKS]
    int32; seq_lens [B] int32 -> [B, NH, HD] fp32, or rounded to fp16 (out_dtype). Grid fixed by
    (B, NKV, MAX_BLOCKS)."""
    b, nh, hd = q.shape
    nkv, block = k_pool.shape[1], k_pool.shape[2]
    assert q.dtype == torch.float32 and k_pool.is_contiguous() and v_pool.is_contiguous()
    assert block & (block - 1) == 0 and nh % nkv == 0, (block, nh, nkv)
    pps, _, nsplit = split_geometry(k_pool, block_table.shape[1])
    q = q.contiguous()
    lens = seq_lens.contiguous()
    m = torch.empty((b, nh, nsplit), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty((b, nh, nsplit, hd), dtype=torch.float32, device=q.device)
    out = torch.empty((b, nh, hd), dtype=out_dtype, device=q.device)
    split_into(q, k_pool, v_pool, block_table.contiguous(), lens, m, l, acc, scale,
               CUDA_SPLIT.get(q.device.index) if q.is_cuda else None)
    _attn_combine_kernel[(b, nh)](m, l, acc, lens, out, nh, nsplit, SPLIT_LEN=pps * block, HD=hd,
                                  HD_P2=triton.next_power_of_2(hd), num_warps=1, **pdl.kw())
    return out


# ---- prefill: causal attention of a step's prompts over their own fp32 K/V ---------------------


@triton.jit
def _prefill_attn_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, pos_ptr, qrow_ptr, qn_ptr, out_ptr, scale,
                         MAX_BLOCKS, NKV: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr,
                         QB: tl.constexpr, HD: tl.constexpr, GDC: tl.constexpr):
    pdl.enter(GDC)
    # program (query block, query head): rows qrow..qrow+qn-1 of ONE prompt (they share its block
    # table); keys walked page by page from position 0 with an online softmax; the dots on tensor
    # cores at fp32 accuracy (tf32x3). A row's bits depend on its prompt alone: the query block, its
    # rows and the pages walked are the prompt's (a page past a row's position is fully masked and
    # leaves its state unchanged).
    qb = tl.program_id(0)
    h = tl.program_id(1)
    nq = tl.load(qn_ptr + qb)
    if nq == 0:
        return
    kvh = h // G
    r0 = tl.load(qrow_ptr + qb)
    i = tl.arange(0, QB)
    rmask = i < nq
    rows = r0 + i
    posr = tl.load(pos_ptr + rows, mask=rmask, other=0)
    npages = tl.max(posr, axis=0) // BLOCK + 1
    d = tl.arange(0, HD)
    j = tl.arange(0, BLOCK)
    q = tl.load(q_ptr + (rows[:, None] * (NKV * G) + h) * HD + d[None, :], mask=rmask[:, None], other=0.0)
    m = tl.full((QB,), float("-inf"), tl.float32)
    l = tl.zeros((QB,), tl.float32)
    acc = tl.zeros((QB, HD), tl.float32)
    for pg in range(0, npages):
        page = tl.load(bt_ptr + r0 * MAX_BLOCKS + pg).to(tl.int64)
        off = ((page * NKV + kvh) * BLOCK + j) * HD
        k = tl.load(k_ptr + off[:, None] + d[None, :])
        v = tl.load(v_ptr + off[:, None] + d[None, :])
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [QB, BLOCK]
        s = tl.where((pg * BLOCK + j)[None, :] <= posr[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new
    tl.store(out_ptr + (rows[:, None] * (NKV * G) + h) * HD + d[None, :], acc / l[:, None],
             mask=rmask[:, None])


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                      pos: torch.Tensor, qrow: torch.Tensor, qn: torch.Tensor, scale: float) -> torch.Tensor:
    """q [N, NH, HD] fp32 (rows of a step's prompts); k/v [S, NKV, BLOCK, HD] fp32 (the prompts'
    scratch blocks); table [N, MAX_BLOCKS] int32 (each row's prompt's blocks); pos [N] int32 (the
    row's position in its prompt); qrow/qn [Q] int32: query blocks (first row, rows; qn 0: unused),
    each inside one prompt -> [N, NH, HD] fp32: row r attends over positions 0..pos[r]; rows in no
    query block are zeros. Grid fixed by (Q, NH)."""
    n, nh, hd = q.shape
    nkv, block = k.shape[1], k.shape[2]
    assert q.dtype == k.dtype == v.dtype == torch.float32 and k.is_contiguous() and v.is_contiguous()
    assert hd & (hd - 1) == 0 and block >= 16 and nh % nkv == 0, (hd, block, nh, nkv)
    out = torch.zeros_like(q)
    _prefill_attn_kernel[(qrow.shape[0], nh)](q.contiguous(), k, v, table.contiguous(), pos, qrow, qn, out,
                                               float(scale), table.shape[1], NKV=nkv, G=nh // nkv, BLOCK=block,
                                               QB=PREFILL_QB, HD=hd, num_warps=4, **pdl.kw())
    return out
