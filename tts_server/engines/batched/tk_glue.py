"""Triton glue of the batched frame (row-local, fixed order, so batch-invariant): per-head q/k
RMSNorm + RoPE + K/V store in one launch, and residual add + RMSNorm in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl


@triton.jit
def _qk_rope_store_kernel(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, cos_stride, q_out_ptr,
                          k_pool_ptr, v_pool_ptr, blk_ptr, off_ptr, eps,
                          NH: tl.constexpr, NKV: tl.constexpr, BS: tl.constexpr, HALF: tl.constexpr, GDC: tl.constexpr):
    pdl.enter(GDC)
    # program (m, head): head < NH: q head -> q_out[m, head]; else kv head -> pool[blk[m], kvh, off[m]]
    m = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    hd = 2 * HALF
    d = tl.arange(0, HALF)
    row = qkv_ptr + m * (NH + 2 * NKV) * hd
    src = row + h * hd
    x1 = tl.load(src + d)
    x2 = tl.load(src + HALF + d)
    is_q = h < NH
    if is_q:
        w_ptr = qn_ptr
    else:
        w_ptr = kn_ptr
    r = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / hd + eps)
    x1 = tl.load(w_ptr + d) * (x1 * r)
    x2 = tl.load(w_ptr + HALF + d) * (x2 * r)
    c1 = tl.load(cos_ptr + m * cos_stride + d)
    c2 = tl.load(cos_ptr + m * cos_stride + HALF + d)
    s1 = tl.load(sin_ptr + m * cos_stride + d)
    s2 = tl.load(sin_ptr + m * cos_stride + HALF + d)
    y1 = x1 * c1 - x2 * s1
    y2 = x2 * c2 + x1 * s2
    if is_q:
        dst = q_out_ptr + (m * NH + h) * hd
        tl.store(dst + d, y1)
        tl.store(dst + HALF + d, y2)
    else:
        kvh = h - NH
        blk = tl.load(blk_ptr + m).to(tl.int64)
        off = tl.load(off_ptr + m).to(tl.int64)
        base = ((blk * NKV + kvh) * BS + off) * hd
        ty = k_pool_ptr.dtype.element_ty
        tl.store(k_pool_ptr + base + d, y1.to(ty))
        tl.store(k_pool_ptr + base + HALF + d, y2.to(ty))
        vsrc = row + (NH + NKV + kvh) * hd
        tl.store(v_pool_ptr + base + d, tl.load(vsrc + d).to(ty))
        tl.store(v_pool_ptr + base + HALF + d, tl.load(vsrc + HALF + d).to(ty))


def qk_rope_store(qkv, q_norm, k_norm, cos, sin, k_pool, v_pool, blk, off, nh, nkv, eps):
    """qkv [M, (NH + 2 NKV) HD] fp32; cos/sin [M or 1, HD] fp32; pools [NB, NKV, BS, HD];
    blk/off [M] int -> q [M, NH, HD] fp32 (normed, roped); k (normed, roped), v stored at
    pool[blk[m], :, off[m]]."""
    m = qkv.shape[0]
    hd = k_pool.shape[-1]
    q = torch.empty(m, nh, hd, dtype=torch.float32, device=qkv.device)
    cs = 0 if cos.shape[0] == 1 else cos.stride(0)
    _qk_rope_store_kernel[(m, nh + nkv)](qkv, q_norm, k_norm, cos, sin, cs, q, k_pool, v_pool, blk, off, eps,
                                         NH=nh, NKV=nkv, BS=k_pool.shape[2], HALF=hd // 2, **pdl.kw())
    return q


@triton.jit
def _add_rms_kernel(x_ptr, y_ptr, w_ptr, sum_ptr, out_ptr, eps, MD, D: tl.constexpr, DP2: tl.constexpr,
                    PARTS: tl.constexpr, GDC: tl.constexpr):
    pdl.enter(GDC)
    # program m: y[m] = y parts [PARTS, M, D] summed in part order (as tk_gemm's split sum);
    # s = x[m] + y[m]; out[m] = w * s * rsqrt(mean(s^2) + eps)
    m = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, DP2)
    mask = d < D
    y = tl.load(y_ptr + m * D + d, mask=mask, other=0.0)
    for p in tl.static_range(1, PARTS):
        y += tl.load(y_ptr + p * MD + m * D + d, mask=mask, other=0.0)
    s = tl.load(x_ptr + m * D + d, mask=mask, other=0.0) + y
    tl.store(sum_ptr + m * D + d, s, mask=mask)
    r = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / D + eps)
    w = tl.load(w_ptr + d, mask=mask, other=0.0)
    h = w * (s * r)
    if out_ptr.dtype.element_ty == tl.float16:  # for fp16 matrices: rounded as tk_gemm rounds x
        h = h.to(tl.float16, fp_downcast_rounding="rtne")
    tl.store(out_ptr + m * D + d, h, mask=mask)


def add_rms(x, y, w, eps, out_dtype=torch.float32):
    """x [M, D] fp32, y [M, D] or partial sums [P, M, D] fp32 (added in order), w [D] fp32 ->
    (x + y, rms_norm(x + y, w)) [M, D] fp32, the norm in out_dtype (fp16: rounded once, for
    products with fp16 matrices)."""
    m, d = x.shape
    y = (y if y.dim() == 3 else y[None]).contiguous()
    s, out = torch.empty_like(x), torch.empty((m, d), dtype=out_dtype, device=x.device)
    _add_rms_kernel[(m,)](x, y, w, s, out, eps, m * d, D=d, DP2=triton.next_power_of_2(d), PARTS=y.shape[0], **pdl.kw())
    return s, out


@triton.jit
def _cp_attend_row(row, out_row, qn_ptr, kn_ptr, cos_ptr, sin_ptr, k_pool_ptr, v_pool_ptr, base, pos, eps, scale, kvh,
                   g0, NH: tl.constexpr, NKV: tl.constexpr, BS: tl.constexpr, HALF: tl.constexpr, GH: tl.constexpr):
    # one (row, kv head) of a code-predictor pass at position `pos`: the row's k/v at this position
    # normed, roped, stored into its scratch block (base: the block's first element for this kv head,
    # which already holds positions 0..pos-1); then its query heads g0 .. g0 + GH - 1 (of the G = NH
    # / NKV) attend over positions 0..pos (the new key from registers) -> out_row[h]. The programs of
    # one kv head's heads store the same K/V values (each computes them the same way).
    G: tl.constexpr = NH // NKV
    hd: tl.constexpr = 2 * HALF
    d = tl.arange(0, HALF)
    c1, c2 = tl.load(cos_ptr + d), tl.load(cos_ptr + HALF + d)
    s1, s2 = tl.load(sin_ptr + d), tl.load(sin_ptr + HALF + d)
    k1 = tl.load(row + (NH + kvh) * hd + d)
    k2 = tl.load(row + (NH + kvh) * hd + HALF + d)
    r = 1.0 / tl.sqrt((tl.sum(k1 * k1, axis=0) + tl.sum(k2 * k2, axis=0)) / hd + eps)
    k1 = tl.load(kn_ptr + d) * (k1 * r)
    k2 = tl.load(kn_ptr + HALF + d) * (k2 * r)
    k1, k2 = k1 * c1 - k2 * s1, k2 * c2 + k1 * s2
    v1 = tl.load(row + (NH + NKV + kvh) * hd + d)
    v2 = tl.load(row + (NH + NKV + kvh) * hd + HALF + d)
    ty = k_pool_ptr.dtype.element_ty
    k1, k2, v1, v2 = k1.to(ty).to(tl.float32), k2.to(ty).to(tl.float32), v1.to(ty).to(tl.float32), v2.to(ty).to(tl.float32)
    tl.store(k_pool_ptr + base + pos * hd + d, k1.to(ty))
    tl.store(k_pool_ptr + base + pos * hd + HALF + d, k2.to(ty))
    tl.store(v_pool_ptr + base + pos * hd + d, v1.to(ty))
    tl.store(v_pool_ptr + base + pos * hd + HALF + d, v2.to(ty))
    j = tl.arange(0, BS)
    prev = j < pos
    kv_off = base + j[:, None] * hd + d[None, :]
    kp1 = tl.load(k_pool_ptr + kv_off, mask=prev[:, None], other=0.0).to(tl.float32)
    kp2 = tl.load(k_pool_ptr + kv_off + HALF, mask=prev[:, None], other=0.0).to(tl.float32)
    vp1 = tl.load(v_pool_ptr + kv_off, mask=prev[:, None], other=0.0).to(tl.float32)
    vp2 = tl.load(v_pool_ptr + kv_off + HALF, mask=prev[:, None], other=0.0).to(tl.float32)
    qw1, qw2 = tl.load(qn_ptr + d), tl.load(qn_ptr + HALF + d)
    for gi in tl.static_range(GH):
        h = kvh * G + g0 + gi
        q1 = tl.load(row + h * hd + d)
        q2 = tl.load(row + h * hd + HALF + d)
        rq = 1.0 / tl.sqrt((tl.sum(q1 * q1, axis=0) + tl.sum(q2 * q2, axis=0)) / hd + eps)
        q1, q2 = qw1 * (q1 * rq), qw2 * (q2 * rq)
        q1, q2 = q1 * c1 - q2 * s1, q2 * c2 + q1 * s2
        sp = (tl.sum(kp1 * q1[None, :], axis=1) + tl.sum(kp2 * q2[None, :], axis=1)) * scale
        sp = tl.where(prev, sp, float("-inf"))
        sn = (tl.sum(k1 * q1, axis=0) + tl.sum(k2 * q2, axis=0)) * scale
        mx = tl.maximum(tl.max(sp, axis=0), sn)
        pp = tl.exp(sp - mx)
        pn = tl.exp(sn - mx)
        inv = 1.0 / (tl.sum(pp, axis=0) + pn)
        o1 = (tl.sum(pp[:, None] * vp1, axis=0) + pn * v1) * inv
        o2 = (tl.sum(pp[:, None] * vp2, axis=0) + pn * v2) * inv
        dst = out_row + h * hd
        if out_row.dtype.element_ty == tl.float16:  # for an o_proj with fp16 matrices
            o1 = o1.to(tl.float16, fp_downcast_rounding="rtne")
            o2 = o2.to(tl.float16, fp_downcast_rounding="rtne")
        tl.store(dst + d, o1)
        tl.store(dst + HALF + d, o2)


@triton.jit
def _cp_attend_kernel(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, out_ptr, k_pool_ptr, v_pool_ptr, pos, eps, scale,
                      NH: tl.constexpr, NKV: tl.constexpr, BS: tl.constexpr, HALF: tl.constexpr, GDC: tl.constexpr,
                      GH: tl.constexpr = 2):
    pdl.enter(GDC)
    # program (m, c) of a code-predictor pass at position `pos` (the same for every row; row m's
    # scratch block is m and already holds positions 0..pos-1): kv head c // (G / GH), its query
    # heads from (c % (G / GH)) * GH -> out[m, h]
    m = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    hd: tl.constexpr = 2 * HALF
    PER: tl.constexpr = NH // NKV // GH
    _cp_attend_row(qkv_ptr + m * (NH + 2 * NKV) * hd, out_ptr + m * NH * hd, qn_ptr, kn_ptr, cos_ptr, sin_ptr,
                   k_pool_ptr, v_pool_ptr, (m * NKV + c // PER) * BS * hd, pos, eps, scale, c // PER, (c % PER) * GH,
                   NH, NKV, BS, HALF, GH)


@triton.jit
def _cp_attend0_kernel(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, out_ptr, k_pool_ptr, v_pool_ptr, eps, scale,
                       NH: tl.constexpr, NKV: tl.constexpr, BS: tl.constexpr, HALF: tl.constexpr, GDC: tl.constexpr,
                       GH: tl.constexpr = 2):
    pdl.enter(GDC)
    # program (stream b, c) of the first code-predictor pass (c as _cp_attend_kernel's): rows 2b and
    # 2b + 1 at positions 0 and 1 of block b, one after the other (position 1 reads the K/V that
    # position 0 stored: this program's own store, or the same values from its kv head's other program)
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    hd: tl.constexpr = 2 * HALF
    PER: tl.constexpr = NH // NKV // GH
    for p in tl.static_range(2):
        _cp_attend_row(qkv_ptr + (2 * b + p) * (NH + 2 * NKV) * hd, out_ptr + (2 * b + p) * NH * hd, qn_ptr, kn_ptr,
                       cos_ptr + p * hd, sin_ptr + p * hd, k_pool_ptr, v_pool_ptr, (b * NKV + c // PER) * BS * hd, p,
                       eps, scale, c // PER, (c % PER) * GH, NH, NKV, BS, HALF, GH)
        if p == 0:
            tl.debug_barrier()  # position 0's K/V stores before position 1's loads of them


# warps per cp_attend program: they set its reductions' order, so one value for every batch size.
# One warp keeps every reduction in shuffles: 3.7 / 4.3 / ~9 us per call at M = 1 / 64 / 256 rows
# against 4.7 / 7.8 / ~27 with four (scripts/gpu_large_b_sweep.py on the H100)
CP_ATTEND_WARPS = 1
# query heads per cp_attend program (of the G = NH / NKV of a kv head): one, so that a kv head's
# heads run side by side (each program also makes the kv head's K/V, the same values: each head's
# arithmetic is unchanged, so are the bits: the frames' signatures equal G's, H200 session 39);
# the graph-replay frame at mixed contexts 3.015 -> 2.905 ms at B = 1, 3.885 -> 3.826 at 16, 4.772
# -> 4.711 at 64, 10.78 -> 10.69 at 256 (scripts/gpu_frames_ab.sh, two rounds a tree). G: one
# program per kv head (the kernels' default)
CP_ATTEND_HEADS = 1


def cp_attend_grid(m: int, nh: int, nkv: int) -> tuple[int, int]:
    """cp_attend's grid for m rows (cp_attend0's: m streams)."""
    return (m, nh // CP_ATTEND_HEADS)


def cp_attend(qkv, q_norm, k_norm, cos, sin, k_pool, v_pool, pos, nh, nkv, eps, scale, out_dtype=torch.float32,
              **launch):
    """qkv [M, (NH + 2 NKV) HD] fp32 at position `pos` of every row; cos/sin [HD] of that position;
    k_pool/v_pool [>= M, NKV, BS, HD] (row m's block is m) -> attention out [M, NH, HD] in out_dtype
    (fp32, or fp16 rounded to nearest even for an o_proj with fp16 matrices)."""
    m = qkv.shape[0]
    hd = k_pool.shape[-1]
    out = torch.empty(m, nh, hd, dtype=out_dtype, device=qkv.device)
    _cp_attend_kernel[cp_attend_grid(m, nh, nkv)](qkv, q_norm, k_norm, cos, sin, out, k_pool, v_pool, pos, eps, scale,
                                                  NH=nh, NKV=nkv, BS=k_pool.shape[2], HALF=hd // 2,
                                                  GH=CP_ATTEND_HEADS, num_warps=CP_ATTEND_WARPS, **pdl.kw(), **launch)
    return out


def cp_attend0(qkv, q_norm, k_norm, cos, sin, k_pool, v_pool, nh, nkv, eps, scale, out_dtype=torch.float32,
               **launch):
    """The first code-predictor pass in one launch: qkv [2B, (NH + 2 NKV) HD] fp32, rows 2b and 2b + 1
    stream b's positions 0 and 1; cos/sin [>= 2, HD] (positions 0, 1); k_pool/v_pool [>= B, NKV,
    BS, HD] (stream b's block is b) -> attention out [2B, NH, HD] in out_dtype (cp_attend at pos 0,
    then 1)."""
    m = qkv.shape[0]
    hd = k_pool.shape[-1]
    assert m % 2 == 0 and cos.is_contiguous() and sin.is_contiguous() and cos.shape[-1] == hd
    out = torch.empty(m, nh, hd, dtype=out_dtype, device=qkv.device)
    _cp_attend0_kernel[cp_attend_grid(m // 2, nh, nkv)](qkv, q_norm, k_norm, cos, sin, out, k_pool, v_pool, eps,
                                                        scale, NH=nh, NKV=nkv, BS=k_pool.shape[2], HALF=hd // 2,
                                                        GH=CP_ATTEND_HEADS, num_warps=CP_ATTEND_WARPS, **pdl.kw(),
                                                        **launch)
    return out


@triton.jit
def _store_blocks_kernel(sk_ptr, sv_ptr, dk_ptr, dv_ptr, dst_ptr, N: tl.constexpr, CHUNK: tl.constexpr,
                         ROUND: tl.constexpr, GDC: tl.constexpr):
    pdl.enter(GDC)
    # program (scratch block s, chunk c): elements [c*CHUNK, +CHUNK) of block s's K and V, rounded
    # to the pool's dtype, into pool block dst[s]; dst[s] < 0: unused, nothing written
    s = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    d = tl.load(dst_ptr + s)
    if d < 0:
        return
    offs = c * CHUNK + tl.arange(0, CHUNK)
    k = tl.load(sk_ptr + s * N + offs)
    v = tl.load(sv_ptr + s * N + offs)
    if ROUND:  # to a narrower float, rounded to nearest even (as torch's .to)
        k = k.to(dk_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        v = v.to(dv_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(dk_ptr + d * N + offs, k)
    tl.store(dv_ptr + d * N + offs, v)


def store_blocks(src_k: torch.Tensor, src_v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 dst: torch.Tensor) -> None:
    """src_k/src_v [S, ...] fp32 scratch blocks -> k_pool/v_pool[dst[s]] (pool dtype); dst [S] long,
    negative: skip. One launch for K and V of every block."""
    s = src_k.shape[0]
    n = src_k[0].numel()
    chunk = 4096 if n % 4096 == 0 else triton.next_power_of_2(n)
    assert n % chunk == 0 and src_k.is_contiguous() and src_v.is_contiguous() and k_pool.is_contiguous()
    _store_blocks_kernel[(s, n // chunk)](src_k, src_v, k_pool, v_pool, dst, N=n, CHUNK=chunk,
                                          ROUND=k_pool.dtype != src_k.dtype, num_warps=4, **pdl.kw())


@triton.jit
def _copy_prefix_kernel(k_ptr, v_ptr, src_ptr, dst_ptr, n_ptr, NKV: tl.constexpr, BS: tl.constexpr, HD: tl.constexpr,
                        GDC: tl.constexpr):
    pdl.enter(GDC)
    # program (copy c, kv head h): positions [0, n[c]) of scratch block src[c] -> block dst[c], K and V
    c = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(n_ptr + c)
    if n == 0:
        return
    p = tl.arange(0, BS)
    d = tl.arange(0, HD)
    src = tl.load(src_ptr + c).to(tl.int64)
    dst = tl.load(dst_ptr + c).to(tl.int64)
    offs = (h * BS + p[:, None]) * HD + d[None, :]
    mask = (p < n)[:, None]
    size = NKV * BS * HD
    tl.store(k_ptr + dst * size + offs, tl.load(k_ptr + src * size + offs, mask=mask), mask=mask)
    tl.store(v_ptr + dst * size + offs, tl.load(v_ptr + src * size + offs, mask=mask), mask=mask)


def copy_prefix(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, n: torch.Tensor) -> None:
    """k/v [S, NKV, BS, HD] scratch blocks; src/dst/n [C] int32: positions 0..n[c]-1 of block src[c]
    copied into block dst[c] (n 0: nothing). One launch for every copy."""
    _, nkv, bs, hd = k.shape
    assert k.is_contiguous() and v.is_contiguous()
    _copy_prefix_kernel[(src.shape[0], nkv)](k, v, src, dst, n, NKV=nkv, BS=bs, HD=hd, num_warps=4, **pdl.kw())


@triton.jit
def _gather_slot(rows_ptr, ints_ptr, floats_ptr, seed_ptr, ig_ptr, fg_ptr, sg_ptr, b, NS, B, FI: tl.constexpr,
                 FF: tl.constexpr, NFI: tl.constexpr, NFF: tl.constexpr):
    # row b's slot = rows[b]: its ints at fields FI and floats at FF into ig / fg [fields, B], its
    # seed into sg[b]; -> the slot (int64). The step inputs' kernels share it.
    slot = tl.load(rows_ptr + b).to(tl.int64)
    for j in tl.static_range(NFI):
        tl.store(ig_ptr + j * B + b, tl.load(ints_ptr + FI[j] * NS + slot))
    for j in tl.static_range(NFF):
        tl.store(fg_ptr + j * B + b, tl.load(floats_ptr + FF[j] * NS + slot))
    tl.store(sg_ptr + b, tl.load(seed_ptr + slot))
    return slot


def _slot_outputs(b: int, fi: tuple, ff: tuple, dev: torch.device):
    """-> (ig [len(fi), B] int32, fg [len(ff), B] fp32, seed [B] int64, counter [B] int64)."""
    return (torch.empty((len(fi), b), dtype=torch.int32, device=dev),
            torch.empty((len(ff), b), dtype=torch.float32, device=dev),
            torch.empty(b, dtype=torch.int64, device=dev), torch.empty(b, dtype=torch.int64, device=dev))


@triton.jit
def _advance_inputs_kernel(rows_ptr, ints_ptr, floats_ptr, seed_ptr, emb_ptr, tab_ptr, codes_ptr, tr_ptr, pad_ptr,
                           bt_ptr, rope_ptr, ig_ptr, fg_ptr, sg_ptr, ctr_ptr, gate_ptr, x_ptr, tbl_ptr, blk_ptr, off_ptr,
                           len_ptr, cos_ptr, sin_ptr, NS, B, V, code_stride, MT, MB, BS, FI: tl.constexpr,
                           FF: tl.constexpr, NFI: tl.constexpr, NFF: tl.constexpr, POS: tl.constexpr,
                           CODE0: tl.constexpr, NSAMP: tl.constexpr, TSTEP: tl.constexpr, NTR: tl.constexpr,
                           EOSF: tl.constexpr, K: tl.constexpr, H: tl.constexpr, HP2: tl.constexpr, MBP2: tl.constexpr,
                           HD: tl.constexpr, GDC: tl.constexpr):
    pdl.enter(GDC)
    # program b: slot = rows[b]; gathers of its state, the talker step's input row and its KV
    # addresses (see glue.advance_inputs)
    b = tl.program_id(0).to(tl.int64)
    slot = _gather_slot(rows_ptr, ints_ptr, floats_ptr, seed_ptr, ig_ptr, fg_ptr, sg_ptr, b, NS, B, FI, FF, NFI, NFF)
    pos = tl.load(ints_ptr + POS * NS + slot)
    n_sampled = tl.load(ints_ptr + NSAMP * NS + slot)
    text_step = tl.load(ints_ptr + TSTEP * NS + slot)
    tl.store(ctr_ptr + b, n_sampled.to(tl.int64))
    tl.store(gate_ptr + b, tl.where(n_sampled >= tl.load(ints_ptr + EOSF * NS + slot), n_sampled, -1))
    # the input row: code 0's embedding + each group's, fp32 adds in order, + the text track
    d = tl.arange(0, HP2)
    mask = d < H
    c0 = tl.load(ints_ptr + CODE0 * NS + slot).to(tl.int64)
    x = tl.load(emb_ptr + c0 * H + d, mask=mask, other=0.0).to(tl.float32)
    for k in tl.static_range(K):
        c = tl.load(codes_ptr + b * code_stride + k).to(tl.int64)
        x = x + tl.load(tab_ptr + (k * V + c) * H + d, mask=mask, other=0.0).to(tl.float32)
    if text_step < tl.load(ints_ptr + NTR * NS + slot):
        text = tl.load(tr_ptr + (slot * MT + tl.minimum(text_step, MT - 1)) * H + d, mask=mask, other=0.0)
    else:
        text = tl.load(pad_ptr + slot * H + d, mask=mask, other=0.0)
    tl.store(x_ptr + b * H + d, x + text.to(tl.float32), mask=mask)
    # its block table row, the new position's block and offset, the length after it
    j = tl.arange(0, MBP2)
    tl.store(tbl_ptr + b * MB + j, tl.load(bt_ptr + slot * MB + j, mask=j < MB, other=0), mask=j < MB)
    tl.store(blk_ptr + b, tl.load(bt_ptr + slot * MB + pos // BS).to(tl.int64))
    tl.store(off_ptr + b, (pos % BS).to(tl.int64))
    tl.store(len_ptr + b, pos + 1)
    # the new position's RoPE rows (rope [positions, 2, HD]: cos, sin)
    e = tl.arange(0, HD)
    rope = rope_ptr + pos.to(tl.int64) * 2 * HD
    tl.store(cos_ptr + b * HD + e, tl.load(rope + e))
    tl.store(sin_ptr + b * HD + e, tl.load(rope + HD + e))


def advance_inputs(rows, ints, floats, seed, embedding, tables, codes, trailing, pad_embed, block_table, block_size,
                   rope, fi, ff, fields):
    b, (ns, h) = rows.shape[0], pad_embed.shape
    k, v, _ = tables.shape
    mt, mb = trailing.shape[1], block_table.shape[1]
    pos, code0, n_sampled, text_step, n_trailing, eos_from = fields
    assert ints.dtype == torch.int32 and floats.dtype == torch.float32 and seed.dtype == torch.int64
    assert codes.dtype == torch.int32 and codes.stride(1) == 1 and block_table.dtype == torch.int32
    assert trailing.is_contiguous() and pad_embed.is_contiguous() and block_table.is_contiguous()
    dev = rows.device
    ig, fg, sg, ctr = _slot_outputs(b, fi, ff, dev)
    gate = torch.empty(b, dtype=torch.int32, device=dev)
    x = torch.empty((b, h), dtype=torch.float32, device=dev)
    tbl = torch.empty((b, mb), dtype=torch.int32, device=dev)
    blk = torch.empty(b, dtype=torch.int64, device=dev)
    off = torch.empty(b, dtype=torch.int64, device=dev)
    lens = torch.empty(b, dtype=torch.int32, device=dev)
    hd = rope.shape[2]
    assert rope.dtype == torch.float32 and rope.is_contiguous() and rope.shape[1] == 2 and hd & (hd - 1) == 0
    cos = torch.empty((b, hd), dtype=torch.float32, device=dev)
    sin = torch.empty((b, hd), dtype=torch.float32, device=dev)
    _advance_inputs_kernel[(b,)](
        rows, ints, floats, seed, embedding.contiguous(), tables.contiguous(), codes, trailing, pad_embed,
        block_table, rope, ig, fg, sg, ctr, gate, x, tbl, blk, off, lens, cos, sin, ns, b, v, codes.stride(0), mt, mb,
        block_size, FI=tuple(fi), FF=tuple(ff), NFI=len(fi), NFF=len(ff), POS=pos, CODE0=code0, NSAMP=n_sampled,
        TSTEP=text_step, NTR=n_trailing, EOSF=eos_from, K=k, H=h, HP2=triton.next_power_of_2(h),
        MBP2=triton.next_power_of_2(mb), HD=hd, **pdl.kw())
    return ig, fg, sg, ctr, gate, x, tbl, blk, off, lens, cos, sin


@triton.jit
def _advance_commit_kernel(rows_ptr, code_ptr, hid_ptr, ints_ptr, past_ptr, seen_ptr, NS, V, scratch,
                           POS: tl.constexpr, CODE0: tl.constexpr, NSAMP: tl.constexpr, TSTEP: tl.constexpr,
                           H: tl.constexpr, HP2: tl.constexpr, GDC: tl.constexpr):
    pdl.enter(GDC)
    # program b: slot = rows[b] advanced one frame (see glue.advance_commit)
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(rows_ptr + b).to(tl.int64)
    code = tl.load(code_ptr + b)
    tl.store(seen_ptr + slot * V + code.to(tl.int64), tl.full((), 1, tl.uint8))
    if slot == scratch:  # graph padding: the scratch slot's step fields stay 0
        for f in tl.static_range(4):
            tl.store(ints_ptr + (POS + f) * NS + slot, tl.zeros((), tl.int32))
    else:
        tl.store(ints_ptr + POS * NS + slot, tl.load(ints_ptr + POS * NS + slot) + 1)
        tl.store(ints_ptr + CODE0 * NS + slot, code)
        tl.store(ints_ptr + NSAMP * NS + slot, tl.load(ints_ptr + NSAMP * NS + slot) + 1)
        tl.store(ints_ptr + TSTEP * NS + slot, tl.load(ints_ptr + TSTEP * NS + slot) + 1)
        d = tl.arange(0, HP2)
        tl.store(past_ptr + slot * H + d, tl.load(hid_ptr + b * H + d, mask=d < H), mask=d < H)


def advance_commit(rows, codes, hidden, ints, past_hidden, seen, scratch, fields):
    b, (ns, h) = rows.shape[0], past_hidden.shape
    pos, code0, n_sampled, text_step = fields
    assert (code0, n_sampled, text_step) == (pos + 1, pos + 2, pos + 3), fields  # four fields in a row
    assert codes.dtype == ints.dtype == torch.int32 and hidden.dtype == past_hidden.dtype == torch.float32
    assert seen.dtype == torch.uint8 and seen.is_contiguous() and hidden.is_contiguous()
    _advance_commit_kernel[(b,)](rows, codes, hidden, ints, past_hidden, seen, ns, seen.shape[1], int(scratch),
                                 POS=pos, CODE0=code0, NSAMP=n_sampled, TSTEP=text_step, H=h,
                                 HP2=triton.next_power_of_2(h), **pdl.kw())


@triton.jit
def _predict_inputs_kernel(rows_ptr, ints_ptr, floats_ptr, seed_ptr, past_ptr, emb_ptr, out_ptr, ig_ptr, fg_ptr,
                           sg_ptr, ctr_ptr, x0_ptr, NS, B, out_stride, FI: tl.constexpr, FF: tl.constexpr,
                           NFI: tl.constexpr, NFF: tl.constexpr, CODE0: tl.constexpr, COUNTER: tl.constexpr,
                           ERR: tl.constexpr, H: tl.constexpr, HP2: tl.constexpr, GDC: tl.constexpr):
    pdl.enter(GDC)
    # program b: slot = rows[b]; gathers of its state, its first pass's two input rows, out's
    # code-0 and error columns (see glue.predict_inputs)
    b = tl.program_id(0).to(tl.int64)
    slot = _gather_slot(rows_ptr, ints_ptr, floats_ptr, seed_ptr, ig_ptr, fg_ptr, sg_ptr, b, NS, B, FI, FF, NFI, NFF)
    tl.store(ctr_ptr + b, tl.load(ints_ptr + COUNTER * NS + slot).to(tl.int64))
    c0 = tl.load(ints_ptr + CODE0 * NS + slot)
    d = tl.arange(0, HP2)
    mask = d < H
    tl.store(x0_ptr + (2 * b) * H + d, tl.load(past_ptr + slot * H + d, mask=mask, other=0.0), mask=mask)
    e0 = tl.load(emb_ptr + c0.to(tl.int64) * H + d, mask=mask, other=0.0).to(tl.float32)
    tl.store(x0_ptr + (2 * b + 1) * H + d, e0, mask=mask)
    tl.store(out_ptr + b * out_stride, c0)
    tl.store(out_ptr + b * out_stride + ERR, tl.zeros((), tl.int32))


def predict_inputs(rows, ints, floats, seed, past_hidden, embedding, out, fi, ff, code0, counter, err_col):
    b, (ns, h) = rows.shape[0], past_hidden.shape
    assert ints.dtype == torch.int32 and floats.dtype == torch.float32 and seed.dtype == torch.int64
    assert past_hidden.dtype == torch.float32 and out.dtype == torch.int32 and out.stride(1) == 1
    dev = rows.device
    ig, fg, sg, ctr = _slot_outputs(b, fi, ff, dev)
    x0 = torch.empty((2 * b, h), dtype=torch.float32, device=dev)
    _predict_inputs_kernel[(b,)](rows, ints, floats, seed, past_hidden, embedding.contiguous(), out, ig, fg, sg, ctr,
                                 x0, ns, b, out.stride(0), FI=tuple(fi), FF=tuple(ff), NFI=len(fi), NFF=len(ff),
                                 CODE0=code0, COUNTER=counter, ERR=err_col, H=h, HP2=triton.next_power_of_2(h),
                                 **pdl.kw())
    return ig, fg, sg, ctr, x0
