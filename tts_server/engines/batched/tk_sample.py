"""Talker logits processing and per-row sampling in Triton (one program per row, whole vocabulary in
registers): temperature -> top-k -> top-p by threshold search -> Gumbel-max with a counter-based
hash RNG identical to ops_ref's (seed, counter, stream, token id)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import pdl


_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# warps of a draw's program (one program a row). The same at every B: the top-p mass is a float
# sum whose order follows the program's layout (the other reductions are exact)
NUM_WARPS = 8


@triton.jit
def _talker_process_kernel(logits_ptr, seen_ptr, rows_ptr, pen_ptr, nsamp_ptr, V, stride_l, stride_s, eos,
                           suppress_start, min_new_tokens, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                           GDC: tl.constexpr):
    pdl.enter(GDC)
    # program (b, chunk): logits[b, chunk] in place; its seen row b, or rows[b] (ROWS)
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    x = tl.load(logits_ptr + b * stride_l + offs, mask=mask, other=0.0)
    srow = tl.load(rows_ptr + b).to(tl.int64) if ROWS else b
    seen = tl.load(seen_ptr + srow * stride_s + offs, mask=mask, other=0)
    p = tl.load(pen_ptr + b)
    pen = tl.where(x < 0, x * p, tl.math.div_rn(x, p))
    x = tl.where(seen != 0, pen, x)
    ninf = float("-inf")
    x = tl.where((offs >= suppress_start) & (offs != eos), ninf, x)
    x = tl.where((offs == eos) & (tl.load(nsamp_ptr + b) < min_new_tokens), ninf, x)
    tl.store(logits_ptr + b * stride_l + offs, x, mask=mask)


def talker_process_(logits, seen, penalty, n_sampled, eos, suppress_start, min_new_tokens, rows=None) -> None:
    """In place on logits [B, V] fp32 (seen [B, V] uint8, or [S, V] with rows [B] int: row b's is
    seen[rows[b]]; penalty [B] fp32, n_sampled [B] int32)."""
    b, v = logits.shape
    seen = seen.view(torch.uint8) if seen.dtype == torch.bool else seen
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    assert seen.stride(1) == 1 and seen.dtype == torch.uint8, (seen.dtype, seen.stride())
    assert rows is None or (rows.shape == (b,) and rows.is_contiguous()), "rows: [B] contiguous"
    blk = 1024
    _talker_process_kernel[(b, triton.cdiv(v, blk))](
        logits, seen, seen if rows is None else rows, penalty.float().contiguous(), n_sampled.int().contiguous(),
        v, logits.stride(0), seen.stride(0), int(eos), int(suppress_start), int(min_new_tokens), BLOCK=blk,
        ROWS=rows is not None, **pdl.kw())


@triton.jit
def _mix32(x):
    # uint32 -> uint32 avalanche hash (lowbias32); ops_ref.mix32 is the same in int64
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _order_key(x):
    # fp32 -> int32 with the same order (+0 and -0 equal); -inf -> -0x7F800000, +inf -> 0x7F800000
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


@triton.jit
def _kth_largest_key(key, valid, k):
    # key [BLOCK_V] int32 order keys, 0 < k < count(valid) -> a threshold t with {key >= t} equal
    # to {key >= the k-th largest valid key}: bisection for the largest t with count(valid & key
    # >= t) >= k between the smallest valid key (count >= k) and the largest + 1 (count 0 < k),
    # stopping early at a t that keeps exactly k (the same set: the k largest). Only ties at the
    # k-th key, where no such t exists, take the whole walk (<= 32 steps). The bounds are int64
    # (their sum overflows int32), every midpoint lies between two keys, so fits an int32.
    lo = tl.min(tl.where(valid, key, 0x7F800000), axis=0).to(tl.int64)
    hi = tl.max(tl.where(valid, key, -0x7F800000), axis=0).to(tl.int64) + 1
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        n = tl.sum(((key >= mid.to(tl.int32)) & valid).to(tl.int32), axis=0)
        exact = n == k
        lo = tl.where(n >= k, mid, lo)
        hi = tl.where(exact, mid + 1, tl.where(n >= k, hi, mid))
    return lo.to(tl.int32)


@triton.jit
def _mass_cut_key(key, e, budget):
    # the largest t with sum(e where key <= t) <= budget (masked entries carry e = 0; key int32,
    # every midpoint fits one)
    lo = tl.full((), -0x7F800001, tl.int64)  # mass(key <= lo) = 0 <= budget
    hi = tl.full((), 0x7F800000, tl.int64)
    for _ in range(32):
        mid = (lo + hi) >> 1
        ok = tl.sum(tl.where(key <= mid.to(tl.int32), e, 0.0), axis=0) <= budget
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    return lo


@triton.jit
def _gumbel(seed_ptr, ctr_ptr, b, offs, STREAM: tl.constexpr, INTERPRET: tl.constexpr):
    # row b's Gumbel noise for token ids offs: 32 hashed bits per (row key, token id), fp64
    return _gumbel_key(tl.load(seed_ptr + b), tl.load(ctr_ptr + b), offs, STREAM, INTERPRET)


@triton.jit
def _gumbel_key(seed, ctr, offs, STREAM: tl.constexpr, INTERPRET: tl.constexpr):
    # the noise for (seed, counter) int64 and the draw's stream
    h = _mix32((seed & 0xFFFFFFFF).to(tl.uint32) ^ 0x9E3779B9)
    h = _mix32(h ^ (seed >> 32).to(tl.uint32))
    h = _mix32(h ^ (ctr & 0xFFFFFFFF).to(tl.uint32))
    h = _mix32(h ^ (ctr >> 32).to(tl.uint32))
    h = _mix32(h ^ STREAM)
    r = _mix32(_mix32(offs.to(tl.uint32) + h) ^ h)
    u = (r.to(tl.float64) + 0.5) * 2.3283064365386963e-10
    if INTERPRET:  # the interpreter has no libdevice; numpy's fp64 log there
        return -tl.log(-tl.log(u))
    else:  # fp64 log from libdevice (__nv_log), the function torch's CUDA log uses
        return -libdevice.log(-libdevice.log(u))


@triton.jit
def _noise_kernel(rows_ptr, seed_ptr, ints_ptr, nsamp_row, noise_ptr, stride_b, stride_s, NS: tl.constexpr,
                  NV0: tl.constexpr, NV: tl.constexpr, CHUNK: tl.constexpr, INTERPRET: tl.constexpr,
                  GDC: tl.constexpr):
    # program (b, c): the Gumbel noise of a frame's draws of row b (slot rows[b]) for token ids
    # c CHUNK .. (c + 1) CHUNK - 1, made as the draws make it (_gumbel with the slot's seed, its
    # draw counter ints[nsamp_row, slot] and the draw's stream): noise[b, 0, :NV0] the talker's
    # (stream 0), noise[b, s, :NV] the code predictor's pass s - 1 (stream s, s = 1..NS-1). Its
    # inputs were written before the frame's graph began (the slot's seed and counter by the
    # admission or the last commit, rows by the host copy), and the previous frame's draws, the
    # only readers, had finished by then too. So under PDL it lets its successor launch first, makes
    # and stores the noise while the kernel before it (predict_inputs) may still run, and waits for
    # that kernel last (its successor waits for this kernel to end, so for that one too).
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    c = tl.program_id(1)
    slot = tl.load(rows_ptr + b).to(tl.int64)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    row = noise_ptr + b * stride_b
    tl.store(row + offs, _gumbel_slot(seed_ptr, ints_ptr, nsamp_row, slot, offs, 0, INTERPRET), mask=offs < NV0)
    if c * CHUNK < NV:
        for s in tl.static_range(1, NS):
            tl.store(row + s * stride_s + offs, _gumbel_slot(seed_ptr, ints_ptr, nsamp_row, slot, offs, s, INTERPRET),
                     mask=offs < NV)
    if GDC:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _gumbel_slot(seed_ptr, ints_ptr, nsamp_row, slot, offs, STREAM: tl.constexpr, INTERPRET: tl.constexpr):
    # _gumbel for a slot of the state: its seed (int64) and its draw counter (N_SAMPLED, int32 in the
    # state, int64 where the frame's inputs gather it) as the draws see them
    return _gumbel_key(tl.load(seed_ptr + slot), tl.load(ints_ptr + nsamp_row + slot).to(tl.int64), offs, STREAM,
                       INTERPRET)


@triton.jit
def _sample_kernel(logits_ptr, ds_ptr, temp_ptr, topk_ptr, topp_ptr, seed_ptr, ctr_ptr, code_ptr,
                   fin_ptr, tab_ptr, emb_ptr, out_ptr, noise_ptr, V, stride_l, stride_p, out_stride, out_col,
                   err_col, bit, noise_stride, STREAM: tl.constexpr, BLOCK_V: tl.constexpr, PARTS: tl.constexpr,
                   H: tl.constexpr, HP2: tl.constexpr, EMBED: tl.constexpr, INTO: tl.constexpr,
                   INTERPRET: tl.constexpr, EARLY: tl.constexpr, NOISE: tl.constexpr, GDC: tl.constexpr):
    # one program per row b: logits[b, :V] (the sum of PARTS partial products, added in part
    # order as tk_gemm's split sum) -> code[b] int32 in [0, V), finite[b] uint8; EMBED: also
    # emb[b] = tab[code[b]] as fp32 (the next code-predictor pass's input row); INTO: also
    # out[b, out_col] = code[b], and out[b, err_col] |= 1 << bit where the row is not finite
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK_V)
    if EARLY:
        # the noise depends on the row's do_sample, seed and counter only, which the caller wrote
        # at least two launches before this one: under PDL every kernel waits for its predecessor
        # before it lets its successor start, so while this program runs the launch before ours
        # has passed its wait, the one before that has finished, and those inputs are visible.
        # So the fp64 logarithms run here, while the logits are still being made (the same
        # values as after the wait). NOISE: frame_noise made them at the frame's start, loaded here
        if NOISE:
            g = tl.load(noise_ptr + b * noise_stride + offs)
        else:
            if tl.load(ds_ptr + b) != 0:
                g = _gumbel(seed_ptr, ctr_ptr, b, offs, STREAM, INTERPRET)
            else:
                g = tl.zeros([BLOCK_V], dtype=tl.float64)
    pdl.enter(GDC)
    valid = offs < V
    ninf = float("-inf")
    x = tl.load(logits_ptr + b * stride_l + offs, mask=valid, other=ninf)
    for p in tl.static_range(1, PARTS):
        x += tl.load(logits_ptr + p * stride_p + b * stride_l + offs, mask=valid, other=ninf)
    bad = (x != x) | (x == float("inf"))
    finite = (tl.sum(bad.to(tl.int32), axis=0) == 0) & (tl.max(tl.where(bad, ninf, x), axis=0) > ninf)
    x = tl.where(finite, x, tl.where(valid, 0.0, ninf))
    code = tl.argmax(x, axis=0, tie_break_left=True)  # greedy: first index among ties
    if tl.load(ds_ptr + b) != 0:
        # temperature, then top-k: keep values >= the k-th largest (search over order keys)
        s = tl.math.div_rn(x, tl.load(temp_ptr + b))
        key = tl.where(valid, _order_key(s), -0x7F800001)  # [BLOCK_V] int32
        k = tl.load(topk_ptr + b)
        if (k > 0) & (k < V):
            s = tl.where(key >= _kth_largest_key(key, valid, k), s, ninf)
        # top-p: remove the smallest values (ties together) whose mass is <= 1 - top_p, not the max
        top_p = tl.load(topp_ptr + b)
        if top_p < 1.0:
            mx = tl.max(s, axis=0)
            e = tl.exp(s - mx)
            key = tl.where(s > ninf, key, -0x7F800001)
            cut = _mass_cut_key(key, e, (1.0 - top_p) * tl.sum(e, axis=0))
            s = tl.where((key <= cut) & (s < mx), ninf, s)
        # Gumbel-max draw, 32 hashed bits per (row key, token id), scored in fp64
        if not EARLY:
            g = _gumbel(seed_ptr, ctr_ptr, b, offs, STREAM, INTERPRET)
        code = tl.argmax(s.to(tl.float64) + g, axis=0, tie_break_left=True)
    code = tl.minimum(tl.maximum(code, 0), V - 1)
    tl.store(code_ptr + b, code.to(tl.int32))
    tl.store(fin_ptr + b, finite.to(tl.uint8))
    if INTO:
        tl.store(out_ptr + b * out_stride + out_col, code.to(tl.int32))
        e = tl.load(out_ptr + b * out_stride + err_col)
        tl.store(out_ptr + b * out_stride + err_col, e | ((1 - finite.to(tl.int32)) << bit))
    if EMBED:
        dh = tl.arange(0, HP2)
        row = tl.load(tab_ptr + code.to(tl.int64) * H + dh, mask=dh < H, other=0.0)
        tl.store(emb_ptr + b * H + dh, row.to(tl.float32), mask=dh < H)


NOISE_CHUNK = 128  # token ids a program of the noise kernel


def frame_noise(rows, seed, ints, nsamp_field: int, noise, nv0: int, nv: int) -> None:
    """The Gumbel noise of a frame's draws for slots rows [B] into noise [>= B, NS, >= nv0] fp64:
    [:, 0, :nv0] the talker's draw (stream 0), [:, s, :nv] the code predictor's pass s - 1 (stream
    s), as sample_tokens makes it with the slot's seed (seed [S] int64) and draw counter
    (ints[nsamp_field] [S] int32); nv0 / nv: the draws' BLOCK_V."""
    b, ns = rows.shape[0], noise.shape[1]
    assert noise.dtype == torch.float64 and noise.stride(2) == 1 and noise.shape[2] >= max(nv0, nv)
    assert seed.dtype == torch.int64 and ints.dtype == torch.int32 and ints.stride(1) == 1
    _noise_kernel[(b, triton.cdiv(max(nv0, nv), NOISE_CHUNK))](
        rows, seed, ints, nsamp_field * ints.stride(0), noise, noise.stride(0), noise.stride(1), NS=ns, NV0=nv0, NV=nv,
        CHUNK=NOISE_CHUNK, INTERPRET=_INTERPRET, num_warps=4, **pdl.kw())


def sample_tokens(logits, do_sample, temperature, top_k, top_p, seed, counter, stream, embed=None, into=None,
                  early=False, noise=None):
    """logits [B, V] fp32, or partial products [P, B, V] added in order -> (codes [B] int32,
    finite [B] bool), and with embed (a [V', H] table) also embed[codes] as [B, H] fp32; into:
    (out, col, err_col, bit), written as well; early: the noise made before the PDL wait; noise
    (with early): frame_noise's rows of this draw ([B, >= BLOCK_V] fp64) instead; see
    ops.sample_tokens."""
    parts = logits if logits.dim() == 3 else logits[None]
    p, b, v = parts.shape
    assert parts.dtype == torch.float32 and parts.stride(2) == 1 and (p == 1 or parts.stride(0) == b * parts.stride(1))
    codes = torch.empty(b, dtype=torch.int32, device=parts.device)
    fin = torch.empty(b, dtype=torch.uint8, device=parts.device)
    i32, f32, i64 = (lambda t: t.int().contiguous()), (lambda t: t.float().contiguous()), \
        (lambda t: t.long().contiguous())  # no-ops for the documented dtypes
    h = embed.shape[1] if embed is not None else 1
    emb = torch.empty((b, h), dtype=torch.float32, device=parts.device) if embed is not None else codes
    out, col, err_col, bit = into if into is not None else (codes, 0, 0, 0)
    assert into is None or (out.dtype == torch.int32 and out.stride(1) == 1)
    block_v = triton.next_power_of_2(v)
    assert noise is None or (early and noise.dtype == torch.float64 and noise.shape[0] >= b
                             and noise.shape[1] >= block_v and noise.stride(1) == 1), "noise: [B, >= BLOCK_V] fp64"
    _sample_kernel[(b,)](parts, i32(do_sample), f32(temperature), i32(top_k), f32(top_p), i64(seed),
                         i64(counter), codes, fin, embed.contiguous() if embed is not None else codes, emb, out,
                         noise if noise is not None else codes, v, parts.stride(1), parts.stride(0), out.stride(0), col,
                         err_col, bit, noise.stride(0) if noise is not None else 0, STREAM=int(stream),
                         BLOCK_V=block_v, PARTS=p, H=h, HP2=triton.next_power_of_2(h),
                         EMBED=embed is not None, INTO=into is not None, INTERPRET=_INTERPRET, EARLY=bool(early),
                         NOISE=noise is not None, num_warps=NUM_WARPS, **pdl.kw())
    if embed is not None:
        return codes, fin.view(torch.bool), emb
    return codes, fin.view(torch.bool)
