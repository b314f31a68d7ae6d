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

__all__ = ["HAS_TRITON", "gemm", "rownorm", "attention"]

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


def _gemm_torch(x, w, out, tout, taps, dil, bias, act, scale, res, snake):
    b, tin, cin = x.shape
    if snake is not None:
        x = _snake(x, *snake)
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
    out.copy_(y)


# ------------------------------------------------------------------------------------------------
# Triton kernels
if HAS_TRITON:

    @triton.jit
    def _gemm_kernel(x_ptr, w_ptr, out_ptr, bias_ptr, scale_ptr, res_ptr, sa_ptr, sb_ptr,
                     M, N, CIN, TIN, TOUT, DIL,
                     TAPS: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                     HAS_SCALE: tl.constexpr, HAS_RES: tl.constexpr, SNAKE: tl.constexpr,
                     PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # out[m, n] = epilogue(sum_j sum_c act_in(x[b, t + j*DIL, c]) * w[j*CIN + c, n]),
        # m = b*TOUT + t; one fixed K loop per output tile, no split-K.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        mmask = rm < M
        nmask = rn < N
        bb = rm // TOUT
        tt = rm - bb * TOUT
        row = (bb.to(tl.int64) * TIN + tt) * CIN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for j in range(TAPS):
            for k0 in range(0, CIN, BK):
                rk = k0 + tl.arange(0, BK)
                kmask = rk < CIN
                a = tl.load(x_ptr + row[:, None] + (j * DIL * CIN) + rk[None, :],
                            mask=mmask[:, None] & kmask[None, :], other=0.0)
                if SNAKE:
                    af = a.to(tl.float32)
                    ea = tl.load(sa_ptr + rk, mask=kmask, other=0.0)
                    ib = tl.load(sb_ptr + rk, mask=kmask, other=0.0)
                    s = libdevice.sin(af * ea[None, :])
                    a = (af + ib[None, :] * (s * s)).to(x_ptr.dtype.element_ty)
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
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=omask)

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
    def _attn_kernel(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, idx_ptr, nf_ptr, out_ptr, scale,
                     H, HKV, QS, KS, VS, C, GRP: tl.constexpr, D: tl.constexpr, BC: tl.constexpr):
        # one program per (row, kv head): its GRP queries against C ring keys + the own key,
        # then the own key/value replaces the ring's oldest entry
        b = tl.program_id(0)
        g = tl.program_id(1)
        slot = tl.load(idx_ptr + b).to(tl.int64)
        n = tl.load(nf_ptr + slot)
        d = tl.arange(0, D)
        kn = tl.load(k_ptr + b * KS + g * D + d).to(tl.float32)
        vn = tl.load(v_ptr + b * VS + g * D + d).to(tl.float32)
        c = tl.arange(0, BC)
        cmask = c < C
        valid = cmask & ((c < n) | (n >= C))
        base = (slot * HKV + g) * C * D
        kk = tl.load(kc_ptr + base + c[:, None] * D + d[None, :], mask=cmask[:, None], other=0.0).to(tl.float32)
        vv = tl.load(vc_ptr + base + c[:, None] * D + d[None, :], mask=cmask[:, None], other=0.0).to(tl.float32)
        for i in range(GRP):
            h = g * GRP + i
            q = tl.load(q_ptr + b * QS + h * D + d).to(tl.float32)
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


def gemm_config(cin: int, n: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BM, BN, BK, warps) from the layer's shape and dtype only, never from the row count."""
    bk = 64 if dtype != torch.float32 else 32
    while bk > 16 and cin % bk:
        bk //= 2
    bn = min(128, max(16, _pow2(n)))
    if n % 128 and n % 64 == 0:
        bn = 64
    return 64, bn, bk, 4


# ------------------------------------------------------------------------------------------------
# dispatch
def gemm(x, w, out, *, tout, taps=1, dil=1, bias=None, act=0, scale=None, res=None, snake=None,
         triton_ok=False, prec="ieee"):
    """Causal conv as implicit GEMM, or a linear (taps=1, tout=tin):
    x [B, Tin, Cin] (Tin = Tout + (taps-1)*dil), w [taps*Cin, N] -> out [B*Tout, N] (written).
    Epilogue order: + bias, GELU (act=1), * scale, + res [B*Tout, N]; snake (ea, ib) [Cin] acts
    on the input first."""
    b, tin, cin = x.shape
    n = w.shape[1]
    if not triton_ok:
        _gemm_torch(x, w, out, tout, taps, dil, bias, act, scale, res, snake)
        return out
    m = b * tout
    bm, bn, bk, warps = gemm_config(cin, n, x.dtype)
    dummy = w
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _gemm_kernel[grid](
        x, w, out, bias if bias is not None else dummy, scale if scale is not None else dummy,
        res if res is not None else dummy, snake[0] if snake else dummy, snake[1] if snake else dummy,
        m, n, cin, tin, tout, dil,
        TAPS=taps, HAS_BIAS=bias is not None, ACT=act, HAS_SCALE=scale is not None,
        HAS_RES=res is not None, SNAKE=snake is not None, PREC=prec if x.dtype == torch.float32 else "tf32",
        BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=3)
    return out


def rownorm(x, w, b, eps, *, layer: bool, triton_ok=False):
    """RMSNorm (layer=False) or LayerNorm over the last dim: x [R, N] -> [R, N] (x's dtype)."""
    if not triton_ok:
        xf = x.float()
        if layer:
            y = F.layer_norm(xf, (xf.shape[-1],), w, b, eps)
        else:
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w
        return y.to(x.dtype)
    out = torch.empty_like(x)
    n = x.shape[-1]
    _rownorm_kernel[(x.shape[0],)](x, w, b if b is not None else w, out, n, eps,
                                   LAYER=layer, BLOCK=_pow2(n), num_warps=4)
    return out


def attention(q, k, v, kc, vc, idx, nf, scale, *, triton_ok=False):
    """One query per row against its slot's ring of C post-RoPE keys plus its own key, then the
    own key/value written into the ring at nf % C. q [B, H, D], k/v [B, Hkv, D] (views allowed
    with unit inner strides), kc/vc [S, Hkv, C, D], idx [B], nf [S] -> out [B, H, D]."""
    bsz, h, d = q.shape
    hkv, c = kc.shape[1], kc.shape[2]
    if not triton_ok:
        n = nf[idx]  # [B]
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
    _attn_kernel[(bsz, hkv)](q, k, v, kc, vc, idx, nf, out, scale, h, hkv, q.stride(0), k.stride(0),
                             v.stride(0), c, GRP=h // hkv, D=d, BC=_pow2(c), num_warps=4)
    return out
