"""Batch-invariant primitives of the batched codec step: one implicit-GEMM causal conv / linear,
a row norm and a one-query sliding-window attention, each as a fixed-config Triton kernel (CUDA)
and a torch reference (CPU). A row's result never depends on the other rows or on the batch size."""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # the GPU path; CPU-only installs run the torch references
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except Exception:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["HAS_TRITON", "attention", "dwconv", "gemm", "rownorm"]

HAS_TRITON = triton is not None
_ROWS = 16  # torch reference: matmuls run as fixed [16, K] @ [K, N] pieces (no batch-size-dependent path)


# ------------------------------------------------------------------------------------------------
# torch references
def _snake(x: torch.Tensor, ea: torch.Tensor, ib: torch.Tensor) -> torch.Tensor:
    """SnakeBeta with precomputed exp(alpha), 1/(exp(beta)+1e-9); x [..., C] -> same, fp32 math."""
    xf = x.float()
    s = torch.sin(xf * ea)
    return (xf + ib * (s * s)).to(x.dtype)


def _mm_fixed(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ w [K, N] -> fp32 [M, N], computed as bmm over fixed 16-row pieces."""
    m, k = a.shape
    pad = (-m) % _ROWS
    if pad:
        a = torch.cat((a, a.new_zeros(pad, k)))
    a = a.float().view(-1, _ROWS, k)
    out = torch.bmm(a, w.float().expand(a.shape[0], *w.shape))
    return out.reshape(-1, w.shape[1])[:m]


def _gemm_torch(x, w, out, out2, tout, taps, dil, bias, act, scale, res, post, post_mod, glu):
    if glu:
        h = x.shape[2] // 2
        x = F.silu(x[..., :h]) * x[..., h:]
    b, tin, cin = x.shape
    cols = [x[:, j * dil : j * dil + tout] for j in range(taps)]  # taps x [B, Tout, Cin]
    a = torch.cat(cols, dim=2).reshape(b * tout, taps * cin)
    y = _mm_fixed(a, w)
    if bias is not None:
        y = y + bias
    if act == 1:
        y = F.gelu(y)
    if scale is not None:
        y = y * scale
    if res is not None:
        y = y + res.reshape(y.shape).float()
    if out is not None:
        out.copy_(y)
    if out2 is not None:
        reps = y.shape[1] // post_mod
        out2.copy_(_snake(y, post[0].repeat(reps), post[1].repeat(reps)))


def _dwconv_torch(x, w, bias, tout, dil):
    acc = x[:, 0:tout].float() * w[0]
    for j in range(1, w.shape[0]):
        acc = acc + x[:, j * dil : j * dil + tout].float() * w[j]
    return (acc + bias).reshape(-1, x.shape[2])


def _rope_torch(x, cos, sin):
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin


# ------------------------------------------------------------------------------------------------
# Triton kernels
if HAS_TRITON:

    @triton.jit
    def _gemm_kernel(x_ptr, w_ptr, out_ptr, out2_ptr, bias_ptr, scale_ptr, res_ptr, sa_ptr, sb_ptr,
                     hist_ptr, idx_ptr, M, N, CIN, TIN, TOUT, DIL, SN_MOD, XS, HIST,
                     TAPS: tl.constexpr, GLU: tl.constexpr, HAS_HIST: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                     HAS_SCALE: tl.constexpr, HAS_RES: tl.constexpr, RAW: tl.constexpr,
                     POST: tl.constexpr, PREC: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # y[m, n] = sum_j sum_c x[b, t + j*DIL, c] * w[j*CIN + c, n], m = b*TOUT + t; one fixed
        # K loop per output tile (no split-K). Epilogue: + bias, GELU, * scale, + res; stores y
        # (RAW) and/or SnakeBeta(y) with per-channel params at n % SN_MOD (POST). x rows are XS
        # apart; GLU: the A operand is silu(x[.., c]) * x[.., CIN + c] (SwiGLU's gate and up).
        # HAS_HIST: input rows t < HIST come from hist[idx[b], t] ([S, HIST, CIN]) and x holds
        # only the TIN - HIST new rows of each batch row (no concatenated copy).
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        mmask = rm < M
        nmask = rn < N
        bb = rm // TOUT
        tt = rm - bb * TOUT
        if HAS_HIST:
            slot = tl.load(idx_ptr + bb, mask=mmask, other=0).to(tl.int64)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for j in range(TAPS):
            ti = tt + j * DIL
            if HAS_HIST:
                inh = ti < HIST
                xrow = (bb.to(tl.int64) * (TIN - HIST) + (ti - HIST)) * XS
                hrow = (slot * HIST + ti) * XS
            else:
                xrow = (bb.to(tl.int64) * TIN + ti) * XS
            for k0 in range(0, CIN, BK):
                rk = k0 + tl.arange(0, BK)
                kmask = rk < CIN
                amask = mmask[:, None] & kmask[None, :]
                ap = x_ptr + xrow[:, None] + rk[None, :]
                if HAS_HIST:
                    ax = tl.load(ap, mask=amask & (~inh)[:, None], other=0.0)
                    ah = tl.load(hist_ptr + hrow[:, None] + rk[None, :], mask=amask & inh[:, None], other=0.0)
                    a = tl.where(inh[:, None], ah, ax)
                else:
                    a = tl.load(ap, mask=amask, other=0.0)
                if GLU:
                    gf = a.to(tl.float32)
                    uf = tl.load(ap + CIN, mask=amask, other=0.0).to(tl.float32)
                    a = (gf / (1.0 + tl.exp(-gf)) * uf).to(x_ptr.dtype.element_ty)
                wr = (j * CIN + rk).to(tl.int64)
                w = tl.load(w_ptr + wr[:, None] * N + rn[None, :],
                            mask=kmask[:, None] & nmask[None, :], other=0.0)
                acc = tl.dot(a, w, acc, input_precision=PREC)
        y = acc
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + rn, mask=nmask, other=0.0)[None, :]
        if ACT == 1:
            y = 0.5 * y * (1.0 + libdevice.erf(y * 0.7071067811865476))
        if HAS_SCALE:
            y = y * tl.load(scale_ptr + rn, mask=nmask, other=0.0)[None, :]
        offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
        omask = mmask[:, None] & nmask[None, :]
        if HAS_RES:
            y = y + tl.load(res_ptr + offs, mask=omask, other=0.0).to(tl.float32)
        if RAW:
            tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=omask)
        if POST:
            ch = rn % SN_MOD
            ea = tl.load(sa_ptr + ch, mask=nmask, other=0.0)
            ib = tl.load(sb_ptr + ch, mask=nmask, other=0.0)
            sv = libdevice.sin(y * ea[None, :])
            tl.store(out2_ptr + offs, (y + ib[None, :] * (sv * sv)).to(out2_ptr.dtype.element_ty), mask=omask)

    @triton.jit
    def _dwconv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, TIN, TOUT, C, DIL,
                       K: tl.constexpr, BC: tl.constexpr):
        # depthwise causal conv, channels last: out[m, c] = sum_j w[j, c] x[b, t + j*DIL, c] + b[c]
        m = tl.program_id(0)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        cm = c < C
        bb = m // TOUT
        base = (bb.to(tl.int64) * TIN + (m - bb * TOUT)) * C
        acc = tl.load(x_ptr + base + c, mask=cm, other=0.0).to(tl.float32) * tl.load(w_ptr + c, mask=cm, other=0.0)
        for j in range(1, K):
            xj = tl.load(x_ptr + base + j * DIL * C + c, mask=cm, other=0.0).to(tl.float32)
            acc = acc + xj * tl.load(w_ptr + j * C + c, mask=cm, other=0.0)
        acc = acc + tl.load(b_ptr + c, mask=cm, other=0.0)
        tl.store(out_ptr + m.to(tl.int64) * C + c, acc, mask=cm)

    @triton.jit
    def _rownorm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, eps,
                        LAYER: tl.constexpr, BLOCK: tl.constexpr):
        # one program per row: RMSNorm (LAYER=0) or LayerNorm (LAYER=1), fp32 statistics
        r = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + r * N + cols, mask=mask, other=0.0).to(tl.float32)
        if LAYER:
            mean = tl.sum(x, axis=0) / N
            xc = tl.where(mask, x - mean, 0.0)
            var = tl.sum(xc * xc, axis=0) / N
            y = xc * libdevice.rsqrt(var + eps)
            y = y * tl.load(w_ptr + cols, mask=mask, other=0.0) + tl.load(b_ptr + cols, mask=mask, other=0.0)
        else:
            var = tl.sum(x * x, axis=0) / N
            y = x * libdevice.rsqrt(var + eps) * tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(out_ptr + r * N + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _attn_kernel(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, idx_ptr, nf_ptr, inv_ptr, out_ptr, scale,
                     rs, H, HKV, QS, KS, VS, C, GRP: tl.constexpr, D: tl.constexpr, BC: tl.constexpr):
        # one program per (row, kv head): RoPE at the slot's frame count on its GRP queries and
        # its key, those queries against C ring keys + the own key, then the own (post-RoPE)
        # key/value replaces the ring's oldest entry
        b = tl.program_id(0)
        g = tl.program_id(1)
        slot = tl.load(idx_ptr + b).to(tl.int64)
        n = tl.load(nf_ptr + slot)
        d = tl.arange(0, D)
        dr = (d + D // 2) % D  # rotate_half: [-x2, x1]
        sg = tl.where(d < D // 2, -1.0, 1.0)
        fr = n.to(tl.float32) * tl.load(inv_ptr + d % (D // 2))
        cs = libdevice.cos(fr) * rs
        sn_ = libdevice.sin(fr) * rs
        kb = k_ptr + b * KS + g * D
        kn = tl.load(kb + d).to(tl.float32) * cs + sg * tl.load(kb + dr).to(tl.float32) * sn_
        vn = tl.load(v_ptr + b * VS + g * D + d).to(tl.float32)
        c = tl.arange(0, BC)
        cmask = c < C
        valid = cmask & ((c < n) | (n >= C))
        base = (slot * HKV + g) * C * D
        kk = tl.load(kc_ptr + base + c[:, None] * D + d[None, :], mask=cmask[:, None], other=0.0).to(tl.float32)
        vv = tl.load(vc_ptr + base + c[:, None] * D + d[None, :], mask=cmask[:, None], other=0.0).to(tl.float32)
        for i in range(GRP):
            h = g * GRP + i
            qb = q_ptr + b * QS + h * D
            q = tl.load(qb + d).to(tl.float32) * cs + sg * tl.load(qb + dr).to(tl.float32) * sn_
            s = tl.sum(kk * q[None, :], axis=1) * scale
            s = tl.where(valid, s, float("-inf"))
            sn = tl.sum(kn * q, axis=0) * scale
            mx = tl.maximum(tl.max(s, axis=0), sn)
            p = tl.exp(s - mx)
            pn = tl.exp(sn - mx)
            den = tl.sum(p, axis=0) + pn
            o = (tl.sum(p[:, None] * vv, axis=0) + pn * vn) / den
            tl.store(out_ptr + (b * H + h) * D + d, o.to(out_ptr.dtype.element_ty))
        tl.debug_barrier()  # every ring read of this program is done before its one write
        pos = n % C
        tl.store(kc_ptr + base + pos * D + d, kn.to(kc_ptr.dtype.element_ty))
        tl.store(vc_ptr + base + pos * D + d, vn.to(vc_ptr.dtype.element_ty))


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def gemm_config(cin: int, n: int, rows: int, dtype: torch.dtype, tiles: dict | None = None):
    """(BM, BN, BK, warps) from the layer alone (input channels, N, output rows per frame,
    dtype), never from the batch: every row of every batch runs the same reduction. `tiles`
    may replace the bf16 bases: {"high": (BM, BN, BK, warps), "low": (...)}."""
    tiles = tiles or {}
    if dtype == torch.float32:
        bm, bn, bk, warps = 64, 64, 32, 4
    elif rows >= 160:  # the high-rate convs: large M at any batch (64x128 measured fastest)
        bm, bn, bk, warps = tiles.get("high", (64, 128, 64, 4))
    else:  # weight-bound at small batch: more, smaller tiles
        bm, bn, bk, warps = tiles.get("low", (64, 64, 64, 4))
    while bk > 16 and cin % bk:
        bk //= 2
    return bm, min(bn, max(16, _pow2(n))), bk, warps


# ------------------------------------------------------------------------------------------------
# dispatch
def gemm(x, w, out, *, tout, taps=1, dil=1, bias=None, act=0, scale=None, res=None, out2=None,
         post=None, post_mod=0, glu=False, hist=None, idx=None, tiles=None, triton_ok=False,
         prec="ieee"):
    """Causal conv as implicit GEMM, or a linear (taps=1, tout=tin):
    x [B, Tin, Cin] (Tin = Tout + (taps-1)*dil), w [taps*Cin, N] -> y [B*Tout, N] written to
    `out` (may be None) and SnakeBeta(y) with post = (exp(alpha), 1/(exp(beta)+1e-9)) at channel
    n % post_mod to `out2`. Epilogue order: + bias, GELU (act=1), * scale, + res [B*Tout, N].
    glu: x is [B, Tin, 2*Cin] and the input is silu(x[..., :Cin]) * x[..., Cin:]. Tiles come
    from the layer (Tout = output rows per frame; `tiles`: see gemm_config). Triton only: with
    hist [S, h, Cin] and idx [B], x holds just the new rows and the first h input rows of batch
    row b are hist[idx[b]] (the caller updates hist afterwards)."""
    if not triton_ok:
        _gemm_torch(x, w, out, out2, tout, taps, dil, bias, act, scale, res, post, post_mod, glu)
        return
    b, tin, xs = x.shape
    hl = 0 if hist is None else hist.shape[1]
    tin += hl
    cin = xs // 2 if glu else xs
    n = w.shape[1]
    m = b * tout
    bm, bn, bk, warps = gemm_config(cin, n, tout, x.dtype, tiles)
    dummy = w
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _gemm_kernel[grid](
        x, w, out if out is not None else dummy, out2 if out2 is not None else dummy,
        bias if bias is not None else dummy, scale if scale is not None else dummy,
        res if res is not None else dummy, post[0] if post else dummy, post[1] if post else dummy,
        hist if hist is not None else dummy, idx if idx is not None else dummy,
        m, n, cin, tin, tout, dil, post_mod or n, xs, hl,
        TAPS=taps, GLU=glu, HAS_HIST=hist is not None, HAS_BIAS=bias is not None, ACT=act, HAS_SCALE=scale is not None,
        HAS_RES=res is not None, RAW=out is not None, POST=out2 is not None,
        PREC=prec if x.dtype == torch.float32 else "tf32", BM=bm, BN=bn, BK=bk,
        num_warps=warps, num_stages=3)


def dwconv(x, w, bias, *, tout, dil=1, triton_ok=False):
    """Depthwise causal conv, fixed tap order: x [B, Tin, C], w [K, C] fp32 -> fp32 [B*Tout, C]."""
    if not triton_ok:
        return _dwconv_torch(x, w, bias, tout, dil)
    b, tin, c = x.shape
    out = torch.empty(b * tout, c, device=x.device, dtype=torch.float32)
    bc = min(1024, _pow2(c))
    _dwconv_kernel[(b * tout, triton.cdiv(c, bc))](x, w, bias, out, tin, tout, c, dil,
                                                   K=w.shape[0], BC=bc, num_warps=4)
    return out


def rownorm(x, w, b, eps, *, layer: bool, out_dtype=None, triton_ok=False):
    """RMSNorm (layer=False) or LayerNorm over the last dim: x [R, N] -> [R, N] in out_dtype."""
    out_dtype = out_dtype or x.dtype
    if not triton_ok:
        xf = x.float()
        if layer:
            y = F.layer_norm(xf, (xf.shape[-1],), w, b, eps)
        else:
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w
        return y.to(out_dtype)
    out = torch.empty(x.shape, device=x.device, dtype=out_dtype)
    n = x.shape[-1]
    _rownorm_kernel[(x.shape[0],)](x, w, b if b is not None else w, out, n, eps,
                                   LAYER=layer, BLOCK=_pow2(n), num_warps=4)
    return out


def attention(q, k, v, kc, vc, idx, nf, inv_freq, rope_scale, scale, *, triton_ok=False):
    """RoPE at position nf[idx] (fp32 angles, as the decoder's rotary embedding), then one query
    per row against its slot's ring of C post-RoPE keys plus its own key; the own key/value are
    written into the ring at nf % C. q [B, H, D], k/v [B, Hkv, D] pre-RoPE (views with unit
    inner strides), kc/vc [S, Hkv, C, D], idx [B], nf [S], inv_freq [D/2] -> out [B, H, D]."""
    bsz, h, d = q.shape
    hkv, c = kc.shape[1], kc.shape[2]
    if not triton_ok:
        n = nf[idx]  # [B]
        fr = n.float()[:, None] * inv_freq[None]
        emb = torch.cat((fr, fr), -1)[:, None]  # [B, 1, D]
        cos, sin = (emb.cos() * rope_scale).to(q.dtype), (emb.sin() * rope_scale).to(q.dtype)
        q, k = _rope_torch(q, cos, sin), _rope_torch(k, cos, sin)
        kg, vg = kc[idx].float(), vc[idx].float()  # [B, Hkv, C, D]
        grp = h // hkv
        if grp > 1:
            kg, vg = kg.repeat_interleave(grp, 1), vg.repeat_interleave(grp, 1)
        qf = q.float()
        kf = k.float().repeat_interleave(grp, 1) if grp > 1 else k.float()
        vf = v.float().repeat_interleave(grp, 1) if grp > 1 else v.float()
        s = (kg * qf[:, :, None, :]).sum(-1) * scale  # [B, H, C]
        cols = torch.arange(c, device=q.device)
        valid = (cols[None] < n[:, None]) | (n[:, None] >= c)  # [B, C]
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        sn = (kf * qf).sum(-1, keepdim=True) * scale  # [B, H, 1]
        p = torch.softmax(torch.cat((s, sn), -1), -1)
        o = (p[..., :c, None] * vg).sum(2) + p[..., c:] * vf
        pos = n % c
        heads = torch.arange(hkv, device=q.device)
        kc[idx[:, None], heads[None], pos[:, None]] = k.to(kc.dtype)
        vc[idx[:, None], heads[None], pos[:, None]] = v.to(vc.dtype)
        return o.to(q.dtype)
    out = torch.empty(bsz, h, d, device=q.device, dtype=q.dtype)
    _attn_kernel[(bsz, hkv)](q, k, v, kc, vc, idx, nf, inv_freq, out, scale, rope_scale, h, hkv,
                             q.stride(0), k.stride(0), v.stride(0), c, GRP=h // hkv, D=d,
                             BC=_pow2(c), num_warps=4)
    return out
