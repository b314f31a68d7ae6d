"""Batch-invariant primitives of the batched codec step: implicit-GEMM causal conv / linear,
depthwise conv, row norm and one-query sliding-window attention; each dispatches to a fixed-config
Triton kernel (CUDA, triton_kernels.py) or a torch reference (CPU). A row's result never depends
on the other rows or on the batch size."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from . import triton_kernels as tk
from .triton_kernels import HAS_TRITON

__all__ = ["HAS_TRITON", "attention", "dwconv", "gemm", "rownorm"]
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
         prec="ieee", split=None):
    """Causal conv as implicit GEMM, or a linear (taps=1, tout=tin):
    x [B, Tin, Cin] (Tin = Tout + (taps-1)*dil), w [taps*Cin, N] -> y [B*Tout, N] written to
    `out` (may be None) and SnakeBeta(y) with post = (exp(alpha), 1/(exp(beta)+1e-9)) at channel
    n % post_mod to `out2`. Epilogue order: + bias, GELU (act=1), * scale, + res [B*Tout, N].
    glu: x is [B, Tin, 2*Cin] and the input is silu(x[..., :Cin]) * x[..., Cin:]. Tiles come
    from the layer (Tout = output rows per frame; `tiles`: see gemm_config). Triton only: with
    hist [S, h, Cin] and idx [B], x holds just the new rows and the first h input rows of batch
    row b are hist[idx[b]] (the caller updates hist afterwards). split: a program per K piece,
    then their ordered sum (the same bits as one program walking them); None: where the grid is
    short (_split_pays)."""
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
    kp, pieces = _pieces(cin, taps, bk)
    grid = (-(-m // bm), -(-n // bn))
    if split is None:  # fp32 (the reference mode) walks the pieces in one program at every B
        split = x.dtype != torch.float32 and _split_pays(grid, pieces, m, n, x.device)
    split = pieces if split and pieces > 1 else 1
    dummy = w
    epi = (out if out is not None else dummy, out2 if out2 is not None else dummy,
           bias if bias is not None else dummy, scale if scale is not None else dummy,
           res if res is not None else dummy, post[0] if post else dummy, post[1] if post else dummy)
    flags = dict(HAS_BIAS=bias is not None, ACT=act, HAS_SCALE=scale is not None, HAS_RES=res is not None,
                 RAW=out is not None, POST=out2 is not None)
    part = torch.empty(pieces, m, n, device=x.device, dtype=torch.float32) if split > 1 else dummy
    tk.gemm_kernel[grid + (split,)](
        x, w, *epi, hist if hist is not None else dummy, idx if idx is not None else dummy, part,
        m, n, cin, tin, tout, dil, post_mod or n, xs, hl,
        TAPS=taps, GLU=glu, HAS_HIST=hist is not None, **flags,
        PREC=prec if x.dtype == torch.float32 else "tf32", BM=bm, BN=bn, BK=bk, KP=kp, PIECED=int(pieces > 1), SPLIT=split,
        num_warps=warps, num_stages=3)
    if split > 1:
        sbm, sbn = 32, min(128, max(16, _pow2(n)))
        tk.gemm_sum_kernel[(-(-m // sbm), -(-n // sbn))](part, *epi, m, n, post_mod or n, PIECES=pieces, **flags,
                                                          BM=sbm, BN=sbn, num_warps=4)


# A codec GEMM's K pieces, from the layer alone (so every batch adds the same pieces in the same
# order). A layer of fewer than LONG_K_STEPS BK steps is one piece (one dot chain, as it always
# was). A longer one is cut into pieces of whole taps, at least MIN_PIECE_STEPS steps each; a tap
# wider than PIECE_COLS columns into equal runs of whole steps, no wider. The pieces are what a
# small batch's split-K spreads over the SMs: its few programs' long K loops.
LONG_K_STEPS = 24
MIN_PIECE_STEPS = 16
PIECE_COLS = int(os.environ.get("TTS_CODEC_PIECE_COLS", 1024))
# split-K (each piece its own program, then an ordered sum) where the unsplit grid fills less
# than this share of the SMs: the small batches' convs are few programs with long K loops
SPLIT_BELOW_WAVE = 1.0
SPLIT_MAX_BYTES = 16 << 20  # the pieces' fp32 partial products
_sms: dict = {}  # device -> SM count


def _pieces(cin: int, taps: int, bk: int) -> tuple[int, int]:
    """(columns per piece, pieces) of a layer's K = taps x each tap's columns padded to whole BK
    steps (see LONG_K_STEPS); a piece is whole BK steps."""
    steps = -(-cin // bk)  # BK steps per tap
    if taps * steps < LONG_K_STEPS:
        return taps * steps * bk, 1
    if steps * bk > PIECE_COLS:  # a wide tap: equal runs of at most PIECE_COLS columns
        kp = -(-steps // -(-steps * bk // PIECE_COLS))
    else:  # whole taps, enough of them for MIN_PIECE_STEPS
        kp = steps * -(-MIN_PIECE_STEPS // steps)
    return kp * bk, -(-taps * steps // kp)


def _split_pays(grid: tuple[int, int], pieces: int, m: int, n: int, device) -> bool:
    if pieces < 2 or pieces * m * n * 4 > SPLIT_MAX_BYTES:
        return False
    if device not in _sms:  # (a CPU entry: scripts/triton_sm90_check.py, compiling as for an H100)
        if device.type != "cuda":
            return False
        _sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return grid[0] * grid[1] < SPLIT_BELOW_WAVE * _sms[device]


def dwconv(x, w, bias, *, tout, dil=1, triton_ok=False):
    """Depthwise causal conv, fixed tap order: x [B, Tin, C], w [K, C] fp32 -> fp32 [B*Tout, C]."""
    if not triton_ok:
        return _dwconv_torch(x, w, bias, tout, dil)
    b, tin, c = x.shape
    out = torch.empty(b * tout, c, device=x.device, dtype=torch.float32)
    bc = min(1024, _pow2(c))
    tk.dwconv_kernel[(b * tout, -(-c // bc))](x, w, bias, out, tin, tout, c, dil,
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
    tk.rownorm_kernel[(x.shape[0],)](x, w, b if b is not None else w, out, n, eps,
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
    tk.attn_kernel[(bsz, hkv)](q, k, v, kc, vc, idx, nf, inv_freq, out, scale, rope_scale, h, hkv,
                             q.stride(0), k.stride(0), v.stride(0), c, GRP=h // hkv, D=d,
                             BC=_pow2(c), num_warps=4)
    return out
