"""The batched frame's own fused glue: Triton (tk_glue.py) on CUDA tensors or under
TRITON_INTERPRET=1, the same math in plain torch otherwise. Row-local, so batch-invariant."""

from __future__ import annotations

import os

import torch

from . import ops


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [M, heads, HD]; cos/sin [M or 1, HD] -> rotate-half RoPE (as model.lm.apply_rope)."""
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, None]


def qk_rope_store(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, blk: torch.Tensor,
                  off: torch.Tensor, nh: int, nkv: int, eps: float) -> torch.Tensor:
    """qkv [M, (NH + 2 NKV) HD] fp32; cos/sin [M or 1, HD]; k_pool/v_pool [NB, NKV, BS, HD]; blk/off
    [M] long -> q [M, NH, HD] fp32 after per-head RMSNorm + RoPE; k (RMSNorm + RoPE) and v of row m
    stored at pool[blk[m], :, off[m]] in the pool's dtype."""
    if _use_triton(qkv):
        from .tk_glue import qk_rope_store as tk

        return tk(qkv, q_norm, k_norm, cos, sin, k_pool, v_pool, blk, off, nh, nkv, eps)
    return qk_rope_store_torch(qkv, q_norm, k_norm, cos, sin, k_pool, v_pool, blk, off, nh, nkv, eps)


def qk_rope_store_torch(qkv, q_norm, k_norm, cos, sin, k_pool, v_pool, blk, off, nh: int, nkv: int,
                        eps: float) -> torch.Tensor:
    m, hd = qkv.shape[0], k_pool.shape[-1]
    qd, kd = nh * hd, nkv * hd
    q = ops.rms_norm(qkv[:, :qd].reshape(m * nh, hd), q_norm, eps).view(m, nh, hd)
    k = ops.rms_norm(qkv[:, qd:qd + kd].reshape(m * nkv, hd), k_norm, eps).view(m, nkv, hd)
    k_pool[blk, :, off] = _rope(k, cos, sin).to(k_pool.dtype)
    v_pool[blk, :, off] = qkv[:, qd + kd:].reshape(m, nkv, hd).to(v_pool.dtype)
    return _rope(q, cos, sin)


def add_rms(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float,
            out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, D] fp32; y [M, D] fp32, or `ops.linear_parts` partials [P, M, D] (summed in order:
    the split GEMM's own sum, one launch fewer); w [D] fp32 -> (s = x + y, rms_norm(s, w)), the
    norm in out_dtype (fp16 for products with fp16 matrices: see ops.rms_norm)."""
    if _use_triton(x):
        from .tk_glue import add_rms as tk

        return tk(x, y, w, eps, out_dtype)
    return add_rms_torch(x, y, w, eps, out_dtype)


def add_rms_torch(x, y, w, eps: float, out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    if y.dim() == 3:
        y, parts = y[0], y
        for p in parts[1:]:
            y = y + p
    s = x + y
    return s, ops.rms_norm(s, w, eps, out_dtype)


def cp_attend(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              k_pool: torch.Tensor, v_pool: torch.Tensor, pos: int, nh: int, nkv: int, eps: float,
              scale: float, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A code-predictor pass at position `pos` of every row, in one launch: q/k RMSNorm +
    RoPE, k/v stored at k_pool[m, :, pos] (row m's scratch block is m), attention of the new query
    over positions 0..pos. qkv [M, (NH + 2 NKV) HD] fp32; cos/sin [1, HD] -> [M, NH, HD] in out_dtype
    (fp16 for an o_proj with fp16 matrices, see ops.paged_attention)."""
    if _use_triton(qkv):
        from .tk_glue import cp_attend as tk

        return tk(qkv, q_norm, k_norm, cos, sin, k_pool, v_pool, pos, nh, nkv, eps, scale, out_dtype)
    return cp_attend_torch(qkv, q_norm, k_norm, cos, sin, k_pool, v_pool, pos, nh, nkv, eps, scale, out_dtype)


def cp_attend_torch(qkv, q_norm, k_norm, cos, sin, k_pool, v_pool, pos: int, nh: int, nkv: int, eps: float,
                    scale: float, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    m, dev = qkv.shape[0], qkv.device
    rows = torch.arange(m, device=dev)
    q = qk_rope_store_torch(qkv, q_norm, k_norm, cos, sin, k_pool, v_pool, rows, torch.full_like(rows, pos),
                            nh, nkv, eps)
    lens = torch.full((m,), pos + 1, dtype=torch.int32, device=dev)
    return ops.paged_attention(q, k_pool, v_pool, rows.to(torch.int32)[:, None], lens, scale, out_dtype)


def cp_attend0(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_pool: torch.Tensor, v_pool: torch.Tensor, nh: int, nkv: int, eps: float, scale: float,
               out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The first code-predictor pass (two rows per stream: rows 2b, 2b + 1 at positions 0 and 1 of
    block b) in one launch instead of three (norm + RoPE + store, paged attention, its merge): as
    cp_attend at position 0 over rows 0::2, then at position 1 over rows 1::2. cos/sin [>= 2, HD]
    -> [2B, NH, HD] in out_dtype."""
    if _use_triton(qkv):
        from .tk_glue import cp_attend0 as tk

        return tk(qkv, q_norm, k_norm, cos[:2].contiguous(), sin[:2].contiguous(), k_pool, v_pool, nh, nkv, eps, scale,
                  out_dtype)
    return cp_attend0_torch(qkv, q_norm, k_norm, cos, sin, k_pool, v_pool, nh, nkv, eps, scale, out_dtype)


def cp_attend0_torch(qkv, q_norm, k_norm, cos, sin, k_pool, v_pool, nh: int, nkv: int, eps: float,
                     scale: float, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    out = torch.empty(qkv.shape[0], nh, k_pool.shape[-1], dtype=out_dtype, device=qkv.device)
    for p in (0, 1):
        out[p::2] = cp_attend_torch(qkv[p::2], q_norm, k_norm, cos[p:p + 1], sin[p:p + 1], k_pool, v_pool, p, nh, nkv,
                                    eps, scale, out_dtype)
    return out


def store_blocks(src_k: torch.Tensor, src_v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 dst: torch.Tensor) -> None:
    """A prefill's fp32 scratch K/V blocks [S, NKV, BS, HD] into the pool's blocks dst [S] long
    (rounded to the pool's dtype); blocks with dst < 0 are skipped (graph padding)."""
    if _use_triton(src_k):
        from .tk_glue import store_blocks as tk

        return tk(src_k, src_v, k_pool, v_pool, dst)
    keep = dst >= 0
    k_pool[dst[keep]] = src_k[keep].to(k_pool.dtype)
    v_pool[dst[keep]] = src_v[keep].to(v_pool.dtype)


def copy_prefix(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, n: torch.Tensor) -> None:
    """A batched prefill's shared prompt prefix: positions 0..n[c]-1 of scratch block src[c] (its
    first prompt's, just stored) copied into block dst[c] (another prompt's) in k and v [S, NKV,
    BS, HD] fp32, before the layer's attention reads them; src/dst/n [C] int32, n 0: no copy."""
    if _use_triton(k):
        from .tk_glue import copy_prefix as tk

        return tk(k, v, src, dst, n)
    for s, d, c in zip(src.tolist(), dst.tolist(), n.tolist()):
        if c:
            k[d, :, :c] = k[s, :, :c]
            v[d, :, :c] = v[s, :, :c]


def advance_inputs(rows: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor, seed: torch.Tensor,
                   embedding: torch.Tensor, tables: torch.Tensor, codes: torch.Tensor, trailing: torch.Tensor,
                   pad_embed: torch.Tensor, block_table: torch.Tensor, block_size: int, rope: torch.Tensor,
                   fi: tuple, ff: tuple, fields: tuple):
    """The talker step's inputs for slots rows [B] (device, int), in one launch for what were ~25
    gathers and elementwise ops: per stream the slot-state ints at fields fi and floats at ff
    ([len(fi), B] int32, [len(ff), B] fp32), the seed [B] int64, the draw counter (N_SAMPLED as
    int64 [B]) and the EOS gate (N_SAMPLED where N_SAMPLED >= EOS_FROM, else -1; int32 [B]); the
    input row [B, H] fp32: embedding[CODE0] + tables[k][codes[:, k]] for k = 0..K-1 + the text
    track's vector (trailing[slot, TEXT_STEP] while TEXT_STEP < N_TRAILING, else pad_embed[slot]),
    fp32 adds in that order; the slot's block_table row [B, MAX_BLOCKS] int32, the new position's
    block and offset in it ([B] int64) and the length with it (POS + 1, int32 [B]); its RoPE rows
    cos, sin [B, HD] fp32 from rope [positions, 2, HD] (rope_cos_sin of every position, made
    once). fields: the state's (POS, CODE0, N_SAMPLED, TEXT_STEP, N_TRAILING, EOS_FROM) rows."""
    if _use_triton(rows):
        from .tk_glue import advance_inputs as tk

        return tk(rows, ints, floats, seed, embedding, tables, codes, trailing, pad_embed, block_table, block_size,
                  rope, fi, ff, fields)
    return advance_inputs_torch(rows, ints, floats, seed, embedding, tables, codes, trailing, pad_embed, block_table,
                                block_size, rope, fi, ff, fields)


def advance_inputs_torch(rows, ints, floats, seed, embedding, tables, codes, trailing, pad_embed, block_table,
                         block_size: int, rope: torch.Tensor, fi: tuple, ff: tuple, fields: tuple):
    """`advance_inputs` in torch ops (the CPU path, and the kernel's reference in the tests)."""
    pos_f, code0_f, n_sampled_f, text_step_f, n_trailing_f, eos_from_f = fields
    ig, fg = ints[:, rows], floats[:, rows]
    pos, n_sampled, text_step = ig[pos_f], ig[n_sampled_f], ig[text_step_f]
    x = embedding[ig[code0_f].long()].float()
    for k in range(codes.shape[1]):
        x = x + tables[k][codes[:, k].long()].float()
    step = text_step.clamp(max=trailing.shape[1] - 1).long()
    text = torch.where((text_step < ig[n_trailing_f])[:, None], trailing[rows, step], pad_embed[rows])
    table = block_table[rows]
    blk = table.gather(1, (pos // block_size).long()[:, None])[:, 0].long()
    gate = torch.where(n_sampled >= ig[eos_from_f], n_sampled, -1)
    return (ig[list(fi)], fg[list(ff)], seed[rows], n_sampled.long(), gate, x + text.float(), table, blk,
            (pos % block_size).long(), pos + 1, rope[pos.long(), 0], rope[pos.long(), 1])


def advance_commit(rows: torch.Tensor, codes: torch.Tensor, hidden: torch.Tensor, ints: torch.Tensor,
                   past_hidden: torch.Tensor, seen: torch.Tensor, scratch: int, fields: tuple) -> None:
    """The talker step's commit for slots rows [B]: POS, N_SAMPLED and TEXT_STEP + 1, CODE0 = the
    drawn codes [B] int32, past_hidden[slot] = hidden [B, H] fp32, seen[slot, code] = 1. The
    scratch slot (graph padding rows) keeps those four fields at 0 and its past hidden state.
    fields: the state's (POS, CODE0, N_SAMPLED, TEXT_STEP) rows, consecutive."""
    if _use_triton(rows):
        from .tk_glue import advance_commit as tk

        return tk(rows, codes, hidden, ints, past_hidden, seen, scratch, fields)
    return advance_commit_torch(rows, codes, hidden, ints, past_hidden, seen, scratch, fields)


def advance_commit_torch(rows, codes, hidden, ints, past_hidden, seen, scratch: int, fields: tuple) -> None:
    pos_f, code0_f, n_sampled_f, text_step_f = fields
    real = rows != scratch  # padding rows (all at the scratch slot) change no state but seen
    r = rows[real]
    for f in (pos_f, n_sampled_f, text_step_f):
        ints[f, r] += 1
    ints[code0_f, r] = codes[real]
    ints[pos_f:text_step_f + 1, scratch] = 0
    past_hidden[r] = hidden[real]
    seen[rows, codes.long()] = 1


def predict_inputs(rows: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor, seed: torch.Tensor,
                   past_hidden: torch.Tensor, embedding: torch.Tensor, out: torch.Tensor, fi: tuple, ff: tuple,
                   code0: int, counter: int, err_col: int):
    """The code predictor's inputs for slots rows [B] (device, int): per stream the slot-state
    ints at fields fi and floats at ff ([len(fi), B] int32, [len(ff), B] fp32), the seed [B]
    int64, ints[counter] as int64 [B], and the first pass's rows [2B, H] fp32 (past_hidden[slot],
    then embedding[ints[code0]] as fp32, per stream). Writes out[:B, 0] = ints[code0] and zeroes
    out[:B, err_col] (the passes add their error bits). One launch for what were ~10 gathers."""
    if _use_triton(rows):
        from .tk_glue import predict_inputs as tk

        return tk(rows, ints, floats, seed, past_hidden, embedding, out, fi, ff, code0, counter, err_col)
    return predict_inputs_torch(rows, ints, floats, seed, past_hidden, embedding, out, fi, ff, code0, counter, err_col)


def predict_inputs_torch(rows, ints, floats, seed, past_hidden, embedding, out, fi, ff, code0, counter, err_col):
    """`predict_inputs` in torch ops (the CPU path, and the kernel's reference in the tests)."""
    b = rows.shape[0]
    ig, fg = ints[:, rows], floats[:, rows]
    c0 = ig[code0]
    x0 = torch.stack((past_hidden[rows], embedding[c0.long()].float()), 1).reshape(2 * b, -1)
    out[:b, 0] = c0
    out[:b, err_col] = 0
    return ig[list(fi)], fg[list(ff)], seed[rows], ig[counter].long(), x0
