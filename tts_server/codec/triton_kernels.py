"""The Triton kernels of the batched codec step (see kernels.py for the calls and the torch
references): implicit-GEMM conv / linear, depthwise conv, row norm, RoPE + ring attention. Each has
one config per layer, so a row's arithmetic never depends on the batch."""

from __future__ import annotations

try:  # the GPU path; CPU-only installs run the torch references
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except Exception:  # pragma: no cover - depends on the install
    triton = None

HAS_TRITON = triton is not None

if HAS_TRITON:

    @triton.jit
    def gemm_kernel(x_ptr, w_ptr, out_ptr, out2_ptr, bias_ptr, scale_ptr, res_ptr, sa_ptr, sb_ptr,
                     hist_ptr, idx_ptr, part_ptr, M, N, CIN, TIN, TOUT, DIL, SN_MOD, XS, HIST,
                     TAPS: tl.constexpr, GLU: tl.constexpr, HAS_HIST: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                     HAS_SCALE: tl.constexpr, HAS_RES: tl.constexpr, RAW: tl.constexpr,
                     POST: tl.constexpr, PREC: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KP: tl.constexpr,
                     PIECED: tl.constexpr, SPLIT: tl.constexpr):
        # y[m, n] = sum_j sum_c x[b, t + j*DIL, c] * w[j*CIN + c, n], m = b*TOUT + t. PIECED = 0:
        # one dot chain over K (tap-major) in BK steps. PIECED = 1: K (each tap's CIN columns padded
        # to whole BK steps) is cut into fixed pieces of KP columns (from the layer alone): a piece
        # is one dot chain over its BK steps from zero, and y is 0 + piece 0 + piece 1 + ... in
        # order. SPLIT = 1: this program walks every piece, then the epilogue; SPLIT = the piece
        # count: program (.., .., s) computes piece s into part[s] and gemm_sum_kernel adds them
        # in the same order and runs the same epilogue, so both give the same bits (split-K for
        # the small batches' short grids).
        # Epilogue: + bias, GELU, * scale, + res; stores y (RAW) and/or SnakeBeta(y) with
        # per-channel params at n % SN_MOD (POST). x rows are XS apart; GLU: the A operand is
        # silu(x[.., c]) * x[.., CIN + c] (SwiGLU's gate and up). HAS_HIST: input rows t < HIST
        # come from hist[idx[b], t] ([S, HIST, CIN]) and x holds only the TIN - HIST new rows of
        # each batch row (no concatenated copy).
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        mmask = rm < M
        nmask = rn < N
        bb = rm // TOUT
        tt = rm - bb * TOUT
        slot = bb.to(tl.int64)
        if HAS_HIST:
            slot = tl.load(idx_ptr + bb, mask=mmask, other=0).to(tl.int64)
        if PIECED == 0:  # one piece: one dot chain over the taps' BK steps in order
            y = tl.zeros((BM, BN), dtype=tl.float32)
            for j in range(TAPS):
                xrow, hrow, inh = _rows(bb, tt, slot, j, TIN, DIL, XS, HIST, HAS_HIST)
                for k0 in range(0, CIN, BK):
                    y = _kstep(y, x_ptr, w_ptr, hist_ptr, xrow, hrow, inh, j, k0 + tl.arange(0, BK), mmask, rn,
                               nmask, N, CIN, GLU, HAS_HIST, PREC)
        else:
            cinp = tl.cdiv(CIN, BK) * BK
            k_all = TAPS * cinp
            if SPLIT == 1:
                p_lo = 0
                p_hi = tl.cdiv(k_all, KP)
            else:
                p_lo = tl.program_id(2)
                p_hi = p_lo + 1
            y = tl.zeros((BM, BN), dtype=tl.float32)
            for piece in range(p_lo, p_hi):
                acc = tl.zeros((BM, BN), dtype=tl.float32)
                for k0 in range(piece * KP, tl.minimum(piece * KP + KP, k_all), BK):
                    j = k0 // cinp
                    xrow, hrow, inh = _rows(bb, tt, slot, j, TIN, DIL, XS, HIST, HAS_HIST)
                    acc = _kstep(acc, x_ptr, w_ptr, hist_ptr, xrow, hrow, inh, j, k0 - j * cinp + tl.arange(0, BK),
                                 mmask, rn, nmask, N, CIN, GLU, HAS_HIST, PREC)
                y = y + acc
        offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
        omask = mmask[:, None] & nmask[None, :]
        if SPLIT == 1:
            _epilogue(y, rn, offs, omask, nmask, out_ptr, out2_ptr, bias_ptr, scale_ptr, res_ptr, sa_ptr,
                      sb_ptr, SN_MOD, HAS_BIAS, ACT, HAS_SCALE, HAS_RES, RAW, POST)
        else:
            tl.store(part_ptr + p_lo * M * N + offs, y, mask=omask)

    @triton.jit
    def _rows(bb, tt, slot, j, TIN, DIL, XS, HIST, HAS_HIST: tl.constexpr):
        # tap j's input rows: x's row offsets, and with HAS_HIST the history's and which rows it holds
        ti = tt + j * DIL
        if HAS_HIST:
            inh = ti < HIST
            xrow = (bb.to(tl.int64) * (TIN - HIST) + (ti - HIST)) * XS
            hrow = (slot * HIST + ti) * XS
        else:
            inh = ti < 0
            xrow = (bb.to(tl.int64) * TIN + ti) * XS
            hrow = xrow
        return xrow, hrow, inh

    @triton.jit
    def _kstep(acc, x_ptr, w_ptr, hist_ptr, xrow, hrow, inh, j, rk, mmask, rn, nmask, N, CIN,
               GLU: tl.constexpr, HAS_HIST: tl.constexpr, PREC: tl.constexpr):
        # one BK step of tap j (input columns rk): acc + A[:, rk] @ W[j*CIN + rk, :]
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
        w = tl.load(w_ptr + wr[:, None] * N + rn[None, :], mask=kmask[:, None] & nmask[None, :], other=0.0)
        return tl.dot(a, w, acc, input_precision=PREC)

    @triton.jit
    def gemm_sum_kernel(part_ptr, out_ptr, out2_ptr, bias_ptr, scale_ptr, res_ptr, sa_ptr, sb_ptr,
                         M, N, SN_MOD, PIECES: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                         HAS_SCALE: tl.constexpr, HAS_RES: tl.constexpr, RAW: tl.constexpr,
                         POST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        # a split gemm_kernel's pieces part [PIECES, M, N] added in order from zero, then its epilogue
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = rn < N
        offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
        omask = (rm < M)[:, None] & nmask[None, :]
        y = tl.zeros((BM, BN), dtype=tl.float32)
        for s in tl.static_range(PIECES):
            y = y + tl.load(part_ptr + s * M * N + offs, mask=omask, other=0.0)  # < 2^31: SPLIT_MAX_BYTES
        _epilogue(y, rn, offs, omask, nmask, out_ptr, out2_ptr, bias_ptr, scale_ptr, res_ptr, sa_ptr,
                  sb_ptr, SN_MOD, HAS_BIAS, ACT, HAS_SCALE, HAS_RES, RAW, POST)

    @triton.jit
    def _epilogue(y, rn, offs, omask, nmask, out_ptr, out2_ptr, bias_ptr, scale_ptr, res_ptr, sa_ptr, sb_ptr,
                  SN_MOD, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_SCALE: tl.constexpr,
                  HAS_RES: tl.constexpr, RAW: tl.constexpr, POST: tl.constexpr):
        # the GEMM's epilogue, elementwise (one code for both paths: the same bits)
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + rn, mask=nmask, other=0.0)[None, :]
        if ACT == 1:
            y = 0.5 * y * (1.0 + libdevice.erf(y * 0.7071067811865476))
        if HAS_SCALE:
            y = y * tl.load(scale_ptr + rn, mask=nmask, other=0.0)[None, :]
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
    def dwconv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, TIN, TOUT, C, DIL,
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
    def rownorm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, eps,
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
    def attn_kernel(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, idx_ptr, nf_ptr, inv_ptr, out_ptr, scale,
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
